"""Contract suites for plugin authors: subclass one in your plugin's tests and fill in its attributes.

``rlx.testing`` is also a pytest plugin (entry point ``pytest11``), giving the ``rlx_plugins``
fixture. Contracts check behaviour the framework relies on, so a plugin that passes its contract works
inside rlx. One suite per component kind: `RewardContract`, `AdvantageContract`, `LossContract`,
`GeneratorContract`, `TransportContract` (starts an engine: mark it integration), `ModelBridgeContract`
and `KernelContract`.
"""

from rlx.testing.contracts import (
                                   AdvantageContract,
                                   GeneratorContract,
                                   KernelContract,
                                   LoggerContract,
                                   LossContract,
                                   ModelBridgeContract,
                                   RewardCase,
                                   RewardContract,
                                   ScriptedEngine,
                                   TransportContract,
)

__all__ = ["AdvantageContract", "GeneratorContract", "KernelContract", "LoggerContract", "LossContract",
           "ModelBridgeContract", "RewardCase", "RewardContract", "ScriptedEngine", "TransportContract"]
