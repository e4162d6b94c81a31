"""megatron-core 0.16.1's reshardable checkpoints (torch_dist, the optimizer's state ``fully_reshardable``) as rlx's
trainers write and read them: synchronously, with torch's own Adam (no Apex, no Transformer Engine).

Writing: megatron's file writer hands its results to the saving process through a queue it gets from a
``multiprocessing`` manager, a server process it spawns at the first save (4 to 6 s here) and that outlives a trainer
killed with -9. A synchronous save puts and takes those results in the saving process itself: a plain queue serves.

Loading: torch's Adam keeps a ``step`` tensor in every parameter's state, which the format saves once, in the
parameter groups. On load megatron

* gives every parameter's state one and the same ``step`` tensor, which torch's Adam then advances in place once per
  parameter at each step: the bias correction runs far ahead, and the first steps after a resume move the weights by
  the wrong amount. Here each parameter gets its own copy;
* copies every key of a parameter's state from what was saved, ``step`` included, and fails on it (KeyError). Here it
  copies the keys that were saved and leaves ``step`` as restored from the parameter groups."""

from __future__ import annotations

import queue
from typing import Any

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

_set_states = DistributedOptimizer._set_main_param_and_optimizer_states
_load_state_dict = DistributedOptimizer.load_state_dict


def _set_saved_states(self: DistributedOptimizer, model_param: Any, tensors: dict[str, Any]) -> None:
    if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        tensors = {**{k: v for k, v in state.items() if k not in tensors}, **tensors}  # each unsaved key onto itself
    _set_states(self, model_param, tensors)


def _load_with_own_steps(self: DistributedOptimizer, state_dict: dict[str, Any]) -> None:
    _load_state_dict(self, state_dict)
    for state in self.optimizer.state.values():
        if "step" in state and hasattr(state["step"], "clone"):  # a tensor (Apex and TE keep it in the groups)
            state["step"] = state["step"].clone()


def install() -> None:
    """Both (idempotent)."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_saved_states  # type: ignore[method-assign]
    DistributedOptimizer.load_state_dict = _load_with_own_steps  # type: ignore[method-assign]
