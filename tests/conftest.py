"""Shared test setup: integration tests must run where only loopback exists (see .ci/run)."""

import os

import pytest


@pytest.fixture(autouse=True)
def _isolate_plugin_env(monkeypatch):
    # A developer's shell settings must not change which plugins tests see.
    monkeypatch.delenv("RLX_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("RLX_DISABLE_PLUGINS", raising=False)
    yield


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``scripts/test`` runs 2 or more workers), the tests of one file go to one worker, so a
    module's shared run is made once, and the live tier's (which share one SGLang server) all to one. Files go out
    in the order `pytest_collection_modifyitems` puts them in: the long ones first, the unit tests last to fill the
    end. (pytest-xdist's ``xdist_group`` marks do nothing under pytest 9.2, which no longer reads the node ids they
    rewrite.)"""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "load":  # a --dist of the caller's own
        return None

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/live/" if path.startswith("tests/live/") else path

    config.option.loadscopereorder = False  # it would order files by their number of tests
    return ByFile(config, log)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker: the order its controller hands files out in
        items.sort(key=lambda item: 0 if item.get_closest_marker("live") else
                   1 if item.get_closest_marker("integration") else 2)


def pytest_report_header(config):
    return f"rlx tests; RLX_NETNS={os.environ.get('RLX_NETNS', '0')} (1: inside a loopback-only namespace)"


# tiny_model_path (the built-in tiny model in a private cache) comes from rlx's pytest plugin
# (rlx.testing.pytest_plugin), which plugins' tests use too.
