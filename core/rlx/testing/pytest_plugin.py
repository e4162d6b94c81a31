"""pytest plugin (entry point ``pytest11``): fixtures for testing rlx plugins."""

from __future__ import annotations

import pytest


@pytest.fixture
def rlx_plugins():
    """A fresh plugin manager with built-ins and installed entry points."""
    from rlx.plugins import build_plugins

    return build_plugins()
