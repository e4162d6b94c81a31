"""`lazy_module`: a module imported on first use, for an optional dependency of a module that loads without it.

The built-in components' modules are imported when the plugins load, and core installs without torch (its extras
bring it): their maths names torch at the top, through this, so that `rl plugins` and `rl config validate` run
without it and do not pay its import (1.8 s here).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _LazyModule(ModuleType):
    def __getattr__(self, attr: str) -> Any:  # only for names not yet looked up
        value = getattr(importlib.import_module(self.__name__), attr)
        setattr(self, attr, value)
        return value


def lazy_module(name: str) -> ModuleType:
    """`name`, imported when an attribute of it is first read (use ``if TYPE_CHECKING: import name`` beside it, for
    the types)."""
    return _LazyModule(name)
