"""Errors a user can cause, shown as one clear line at the CLI and never as a traceback.

Every message says what was wrong, where (file, line, key path, plugin) and, when it helps, what to do.
Code that catches a third-party exception re-raises it as an `RLXError` with that context added.
"""

from __future__ import annotations


class RLXError(Exception):
    """A problem the user can fix: bad config, bad data row, unreachable engine, a plugin's error."""

    exit_code = 1


class ConfigError(RLXError):
    """One or more configuration problems, reported together.

    Each problem is a `(where, message)` pair, `where` being `file:line: key.path` when known.
    """

    exit_code = 2

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        head = f"{len(problems)} problem{'s' if len(problems) != 1 else ''} in config"
        if source:
            head += f" {source}"
        lines = [f"  {where}: {msg}" for where, msg in problems]
        super().__init__(head + ":\n" + "\n".join(lines))


class EngineError(RLXError):
    """An engine could not be reached, or answered with an error (`status`: its HTTP status, when it answered)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class PluginError(RLXError):
    """A plugin failed to load, has a misspelled hook, or clashes with another plugin (`plugin`: its name, where
    one plugin is at fault)."""

    exit_code = 2

    def __init__(self, message: str, plugin: str | None = None):
        super().__init__(message)
        self.plugin = plugin


class Interrupted(RLXError):
    """The run was stopped by a signal (Ctrl-C, SIGTERM): exit code 128 + the signal's number, as shells
    report it. Not an error of the run: the message says what was saved and how to go on."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
