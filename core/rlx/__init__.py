"""rlx: reinforcement-learning post-training for LLMs, built for agents.

A plugin needs only ``from rlx import hookimpl``; see `rlx.hookspecs` for every hook.
"""

from rlx import _megatron_import
from rlx.hookspecs import hookimpl

_megatron_import.install()

__all__ = ["hookimpl", "__version__"]
__version__ = "0.1.0"
