"""Shared test setup: integration tests must run where only loopback exists (see .ci/run)."""

import os

import pytest


@pytest.fixture(autouse=True)
def _isolate_plugin_env(monkeypatch):
    # A developer's shell settings must not change which plugins tests see.
    monkeypatch.delenv("RLX_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("RLX_DISABLE_PLUGINS", raising=False)
    yield


def pytest_report_header(config):
    return f"rlx tests; RLX_NETNS={os.environ.get('RLX_NETNS', '0')} (1: inside a loopback-only namespace)"


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """The built-in tiny model, built once per test session in a private cache."""
    cache = tmp_path_factory.mktemp("rlx-cache")
    os.environ["RLX_CACHE"] = str(cache)  # engine subprocesses inherit it
    from rlx.models.tiny import resolve_model_path

    return resolve_model_path("builtin://tiny-qwen3")
