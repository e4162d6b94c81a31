"""Shared test setup: integration tests must run where only loopback exists (see .ci/run)."""

import os

import pytest


@pytest.fixture(autouse=True)
def _isolate_plugin_env(monkeypatch):
    # A developer's shell settings must not change which plugins tests see.
    monkeypatch.delenv("RLX_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("RLX_DISABLE_PLUGINS", raising=False)
    yield


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``scripts/test``: ``--dist loadfile --no-loadscope-reorder``, a file's tests in one
    worker, so a module's shared run is made once) the files go out in this order: the live tier's first, then the
    other integration tests, then the short ones to fill the end."""
    if hasattr(config, "workerinput"):  # an xdist worker: its collection's order is the one files go out in
        items.sort(key=lambda item: 0 if item.get_closest_marker("live") else
                   1 if item.get_closest_marker("integration") else 2)


def pytest_report_header(config):
    return f"rlx tests; RLX_NETNS={os.environ.get('RLX_NETNS', '0')} (1: inside a loopback-only namespace)"


# tiny_model_path (the built-in tiny model in a private cache) comes from rlx's pytest plugin
# (rlx.testing.pytest_plugin), which plugins' tests use too.
