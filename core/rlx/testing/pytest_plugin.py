"""pytest plugin (entry point ``pytest11``): fixtures for testing rlx plugins."""

from __future__ import annotations

import os
import signal

import pytest


def pytest_configure(config):
    """Processes the tests start get default signal dispositions: an ignored signal is inherited through exec,
    and a shell ignores SIGINT and SIGQUIT for the jobs it puts in the background (SIGHUP under nohup), so a
    suite run that way would start `rl serve` deaf to the Ctrl-C its tests send. Handled signals reset on exec."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """The built-in tiny model (``builtin://tiny-qwen3``), built once per test session in a private cache
    (``RLX_CACHE`` points there, so engines started by the test build other built-ins there too)."""
    cache = tmp_path_factory.mktemp("rlx-cache")
    os.environ["RLX_CACHE"] = str(cache)  # engine subprocesses inherit it
    from rlx.models.tiny import resolve_model_path

    return resolve_model_path("builtin://tiny-qwen3")


@pytest.fixture
def rlx_plugins():
    """A fresh plugin manager with built-ins and installed entry points."""
    from rlx.plugins import build_plugins

    return build_plugins()
