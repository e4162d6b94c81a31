"""Engines: the SGLang HTTP protocol client, the embedded engine, and launching or attaching engines."""
