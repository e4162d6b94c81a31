"""Model helpers that need no plugin: resolving model paths and the tiny built-in model."""
