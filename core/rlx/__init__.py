"""rlx: reinforcement-learning post-training for LLMs, built for agents.

A plugin needs only ``from rlx import hookimpl``; see `rlx.hookspecs` for every hook.
"""

from rlx.hookspecs import hookimpl

__all__ = ["hookimpl", "__version__"]
__version__ = "0.1.0"
