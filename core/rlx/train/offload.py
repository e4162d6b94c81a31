"""Colocated offload: a trainer that shares its GPU with engines gives its GPU memory back while they generate,
and with several models (actor, reference, critic) only the ones at work stay on the GPU.

``train.offload`` (`rlx.config.trainer_offloads`; None: as the engines' ``rollout.offload_during_train``, on in
sync mode when colocated on GPUs). The trainer gives its memory back from its start, so the engines size their
cache by all of it. Per step:

* generation: nothing of the trainer's on the GPU (the engines' turn);
* the critic's values and updates (PPO): the critic alone;
* the actor's update: the actor, with its gradients and optimizer state, and the reference model's weights;
* a weight push, a checkpoint or an HF export: the actor's weights (the optimizer state too for a checkpoint);
* then nothing again.

Mechanism: every GPU storage of a role (megatron's contiguous parameter and gradient buffers, the optimizer's
fp32 main parameters and Adam moments) is copied to pinned host memory and its storage resized to zero, then
resized and copied back. Tensors that are views into a storage (each parameter into megatron's buffer, each
``main_grad``) stay valid, since the storage object is the same; gradients are not copied (every update starts
by zeroing them). On a CPU there is no device memory to give back: offload is a no-op that says so once, and
the schedule is kept all the same (tests read it from `Residency.history`).
"""

from __future__ import annotations

import sys
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rlx.train.model import ModelRole

PARTS = ("weights", "all")  # what of a role is on the device; absent from a hold: nothing


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class RoleMemory:
    """The device storages of one model role, in two parts: its weights, and its training state (gradients and
    optimizer state, which exist only once the role trains)."""

    def __init__(self, role: ModelRole, device: torch.device):
        self.role, self.device = role, device
        self.away: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor | None, int]]] = {}

    def _tensors(self, part: str) -> list[tuple[torch.Tensor, bool]]:
        """(tensor, keep its values) of `part`: ``weights`` or ``state``."""
        role = self.role
        if part == "weights":
            if role.ddp is not None:  # parameters are views into megatron's contiguous buffers
                buffers = role.ddp.buffers + role.ddp.expert_parallel_buffers
                # and the frozen ones (LoRA's base, `rlx.train.lora`), which megatron's buffers leave out
                return ([(b.param_data, True) for b in buffers if b.param_data is not None]
                        + [(p, True) for p in role.model.parameters() if not p.requires_grad])
            return [(p, True) for p in role.model.parameters()]
        out: list[tuple[torch.Tensor, bool]] = []
        if role.ddp is not None:
            out += [(b.grad_data, False) for b in role.ddp.buffers + role.ddp.expert_parallel_buffers]
        if role.optimizer is not None:
            for inner in role._inner_optimizers():
                out += [(p, True) for g in inner.param_groups for p in g["params"]]
                out += [(v, True) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return out

    def offload(self, part: str, skip: set[int]) -> int:
        """Move `part`'s device storages (but those in `skip`) to host memory; the bytes moved."""
        moved, seen, done = 0, set(skip), []
        for t, keep in self._tensors(part):
            storage = t.untyped_storage()
            if t.device.type != self.device.type or _key(t) in seen or storage.nbytes() == 0:
                continue
            seen.add(_key(t))
            size = storage.nbytes()
            host = None
            if keep:
                host = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
                host.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage), non_blocking=True)
            done.append((storage, host, size))
            moved += size
        self._sync()
        for storage, _, _ in done:
            storage.resize_(0)
        self.away[part] = done
        return moved

    def onload(self, part: str) -> int:
        moved = 0
        for storage, host, size in self.away.pop(part, []):
            storage.resize_(size)
            view = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            if host is None:
                view.zero_()
            else:
                view.copy_(host, non_blocking=True)
            moved += size
        self._sync()
        return moved

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def keys(self, part: str) -> set[int]:
        return {_key(t) for t, _ in self._tensors(part) if t.device.type == self.device.type}


class Residency:
    """Which roles (and which parts of them) are on the device; `hold` moves the rest away. With `enabled`
    false (no colocated offload) every role stays resident and `hold` does nothing."""

    MOVES = ("cuda",)  # device types whose memory is moved (tests add "cpu": host memory to host memory)

    def __init__(self, enabled: bool, roles: dict[str, Any], device: torch.device):
        self.enabled = enabled
        self.moves = enabled and device.type in self.MOVES
        self.memory = {name: RoleMemory(role, device) for name, role in roles.items() if role is not None}
        self.state: dict[str, str | None] = {name: "all" for name in self.memory}
        # the last holds' resident roles (what tests check the schedule by; bounded: a run holds 4-6 times a step)
        self.history: deque[dict[str, str]] = deque(maxlen=256)
        self.moved_bytes = 0
        if enabled and not self.moves:
            print("rlx: train.offload: the trainer runs on the CPU, so there is no device memory to give back; the "
                  "offload schedule is kept without moving anything", file=sys.stderr, flush=True)

    def hold(self, **parts: str) -> None:
        """Make exactly `parts` resident (role name -> ``"weights"`` or ``"all"``); every other role is moved to
        host memory. Offloads go first, so the peak is what the new set needs."""
        if not self.enabled:
            return
        bad = {k: v for k, v in parts.items() if k not in self.state or v not in PARTS}
        if bad:
            raise ValueError(f"hold: unknown roles or parts {bad} (roles {sorted(self.state)}, parts {PARTS})")
        want = {name: parts.get(name) for name in self.state}
        for name, target in want.items():  # offloads first
            now = self.state[name]
            if now == "all" and target != "all":
                self._move(name, "state", away=True)
            if now is not None and target is None:
                self._move(name, "weights", away=True)
        for name, target in want.items():
            now = self.state[name]
            if now is None and target is not None:
                self._move(name, "weights", away=False)
            if target == "all" and now != "all":
                self._move(name, "state", away=False)
            self.state[name] = target
        self.history.append({k: v for k, v in want.items() if v is not None})

    def held_bytes(self) -> int:
        """Bytes of device storage the roles hold now (weights, gradients, optimizer state)."""
        sizes = {}
        for mem in self.memory.values():
            for part in ("weights", "state"):
                sizes.update({_key(t): t.untyped_storage().nbytes() for t, _ in mem._tensors(part)
                              if t.device.type == mem.device.type})
        return sum(sizes.values())

    def _move(self, name: str, part: str, away: bool) -> None:
        if not self.moves:
            return
        mem = self.memory[name]
        if away:
            skip = mem.keys("weights") if part == "state" else set()  # fp32 main params may be the weights
            self.moved_bytes += mem.offload(part, skip)
        else:
            self.moved_bytes += mem.onload(part)
