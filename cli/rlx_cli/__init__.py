"""The `rl` command-line interface."""
