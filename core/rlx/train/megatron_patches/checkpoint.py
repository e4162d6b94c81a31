"""megatron-core 0.16.1's reshardable checkpoints (torch_dist, the optimizer's state ``fully_reshardable``) as rlx's
trainers write and read them, with torch's own Adam (no Apex, no Transformer Engine).

Writing, in the background (`BackgroundWrites`): megatron's asynchronous save plans the checkpoint with every rank
(collectives) and hands back the file writes and the finalisation (collectives again: rank 0 writes the metadata).
Here the rank copies what is to be written (megatron's own staging copies only GPU tensors: a CPU tensor would be
written while the next step changes it), writes the files in a thread while it trains on, and finalises at its next
call from the driver, which every rank gets in the same order. Megatron's file writer hands its results to the
saving process through a queue it gets from a ``multiprocessing`` manager, a server process it spawns at the first
save (4 to 6 s here) that outlives a trainer killed with -9; the writes run in the saving process, so a plain queue
serves.

Loading: torch's Adam keeps a ``step`` tensor in every parameter's state, which the format saves once, in the
parameter groups. On load megatron

* gives every parameter's state one and the same ``step`` tensor, which torch's Adam then advances in place once per
  parameter at each step: the bias correction runs far ahead, and the first steps after a resume move the weights by
  the wrong amount. Here each parameter gets its own copy;
* copies every key of a parameter's state from what was saved, ``step`` included, and fails on it (KeyError). Here it
  copies the keys that were saved and leaves ``step`` as restored from the parameter groups."""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
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


class BackgroundWrites:
    """A rank's checkpoint writes (megatron's `AsyncRequest` of each saved role) run in one thread, in order, while
    the rank trains on; `finish` waits for them and finalises them, on every rank at the same call."""

    def __init__(self) -> None:
        self.requests: list[AsyncRequest] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()  # a rank in the driver's process is called from more than one thread

    def add(self, request: AsyncRequest) -> None:
        """Stage `request`'s tensors (copies: the rank may change its own from now on); written at `start`."""
        if request.async_fn is not None:
            rank, buckets, results = request.async_fn_args
            staged = [(file, key, (data, [(item, t.detach().to("cpu", copy=True)) for item, t in tensors]))
                      for file, key, (data, tensors) in buckets]
            request = request._replace(async_fn_args=(rank, staged, results))
        self.requests.append(request)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._write, name="rlx-checkpoint-writes", daemon=True)
        self.thread.start()

    def _write(self) -> None:
        try:
            for r in self.requests:
                if r.async_fn is not None:
                    r.async_fn(*r.async_fn_args, **r.async_fn_kwargs)
        except BaseException as e:  # noqa: BLE001 - raised in `finish`, on the rank's own thread
            self.error = e

    def finish(self, wait: bool = True) -> bool:
        """Finalise the writes once every rank's are done (collectives: every rank calls this at the same call);
        `wait`: for this rank's first. True when nothing is left pending."""
        with self.lock:
            if self.thread is None:
                return True
            if wait:
                self.thread.join()
            # each rank's state, which every rank learns here, so that none waits for another: 0 written,
            # 1 writing, 2 failed
            mine = 1.0 if self.thread.is_alive() else 2.0 if self.error is not None else 0.0
            state = torch.tensor([mine], device="cuda" if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(state, op=dist.ReduceOp.MAX)
            if state.item() == 1.0:
                return False
            requests, error, self.requests, self.thread, self.error = self.requests, self.error, [], None, None
            if error is not None:
                raise error
            if state.item() == 2.0:
                raise RuntimeError("another trainer rank failed to write its part of the checkpoint (its log says why)")
            for r in requests:
                for fn in r.finalize_fns:
                    fn()
            return True


def regrouped(saved: dict[Any, Any], loaded: dict[Any, Any], template: dict[Any, Any], parts: int) -> dict[Any, Any]:
    """The optimizer's state to load, `loaded` as megatron read it, its parameter groups as this run's optimizer of
    `parts` parts holds them. With ep > 1 megatron keeps the experts' parameters in an optimizer of their own (two
    parts, each its own groups), with ep = 1 in one; the state tensors are saved by parameter name (`template`'s
    sharded tensors, filled in `loaded`) and load under either, but the groups (the learning rate's settings, Adam's
    step) are saved per part. Between ep = 1 and ep > 1 each group of this run takes the saved group of the same kind
    (weight decay and learning-rate multipliers; expert or not where both have it)."""
    saved_parts = [saved[k] for k in sorted(saved)] if all(isinstance(k, int) for k in saved) else [saved]
    if len(saved_parts) == parts:
        return loaded
    groups = [g for part in saved_parts for g in part["optimizer"]["param_groups"]]

    def kind(g: dict[str, Any], expert: bool = True) -> tuple[Any, ...]:
        return (g["wd_mult"], g["lr_mult"], g["is_decoupled_lr"]) + ((g["is_expert_parallel"],) if expert else ())

    def like(want: dict[str, Any]) -> dict[str, Any]:
        match = [g for g in groups if kind(g) == kind(want)] or [g for g in groups if kind(g, False) == kind(want, False)]
        if not match:
            raise RuntimeError(f"no saved parameter group like {kind(want)} among {[kind(g) for g in groups]}")
        return {**match[0], "is_expert_parallel": want["is_expert_parallel"]}

    def part(here: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
        return {"optimizer": {"param_groups": [like(g) for g in here["optimizer"]["param_groups"]]},
                "param_state_sharding_type": saved_parts[0]["param_state_sharding_type"],
                "param_state": tensors["param_state"]}

    if parts == 1:
        return part(template, loaded)
    return {i: part(template[i], loaded[i]) for i in range(parts)}
