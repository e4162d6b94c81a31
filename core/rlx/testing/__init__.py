"""Contract suites for plugin authors: subclass one in your plugin's tests and fill in its attributes.

``rlx.testing`` is also a pytest plugin (entry point ``pytest11``), giving the ``rlx_plugins``
fixture. Contracts check behaviour the framework relies on, so a plugin that passes its contract works
inside rlx: it is registered under its name, its config has defaults, it scores the cases you give,
it never raises on odd input, and it is deterministic.
"""

from rlx.testing.contracts import RewardCase, RewardContract

__all__ = ["RewardCase", "RewardContract"]
