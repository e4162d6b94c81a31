"""Prompt datasets, procedural tasks and (later) rollout buffers."""
