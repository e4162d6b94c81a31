"""Weight updates for the embedded engine: from disk, from serialized tensors, and by broadcast.

The same three ways SGLang takes weights, with the same request fields. The broadcast group is built
from a ``TCPStore`` and a process group object directly (not ``init_process_group``), so neither side
gives up its default group: the trainer keeps Megatron's, the engine has none. The trainer is rank 0.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rlx.transport.wire import WireError, deserialize_named_tensors

__all__ = ["BroadcastGroup", "WeightError", "WireError", "checksums", "deserialize_named_tensors", "load_from_disk",
           "load_named", "weights_by_name"]

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "torch.float32": torch.float32, "torch.float16": torch.float16, "torch.bfloat16": torch.bfloat16,
}


class WeightError(WireError):
    """A weight update that cannot be applied (unknown name, wrong shape, unreadable file)."""


def load_named(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> int:
    """Copy tensors into the model's parameters and buffers by name; all checked before any copy."""
    state = model.state_dict(keep_vars=True)  # tied weights appear under every name they have
    for name, t in named:
        if name not in state:
            raise WeightError(f"unknown weight {name!r}")
        if tuple(state[name].shape) != tuple(t.shape):
            raise WeightError(f"weight {name!r}: shape {tuple(t.shape)} != model's {tuple(state[name].shape)}")
    with torch.no_grad():
        for name, t in named:
            state[name].copy_(t.to(device=state[name].device, dtype=state[name].dtype))
    return len(named)


def load_from_disk(model: torch.nn.Module, path: str) -> int:
    """Load every ``*.safetensors`` file of an HF checkpoint directory into the model."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {path}")
    named: list[tuple[str, torch.Tensor]] = []
    for f in files:
        named += list(load_file(str(f)).items())
    return load_named(model, named)


class BroadcastGroup:
    """The engine's end of a trainer→engines broadcast group."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float = 300, local_address: str | None = None):
        """`local_address`: the address this engine serves on; gloo binds to it (across hosts the
        default, the hostname's address, is often loopback)."""
        import torch.distributed as dist

        if rank <= 0:
            raise WeightError("engine ranks start at 1 (the trainer is rank 0)")
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        store = dist.PrefixStore(group_name, store)
        self.name, self.rank, self.world_size = group_name, rank, world_size
        if backend == "gloo":
            from rlx.net import gloo_options

            opts = gloo_options(local_address)
            opts._timeout = timedelta(seconds=timeout_s)
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise WeightError(f"unknown backend {backend!r}; use gloo or nccl")

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WeightError("names, dtypes and shapes must have the same length")
        out = []
        for name, dt, shape in zip(names, dtypes, shapes, strict=True):
            if dt not in DTYPES:
                raise WeightError(f"weight {name!r}: unknown dtype {dt!r}")
            t = torch.empty(shape, dtype=DTYPES[dt], device=self.device)
            self.pg.broadcast(t, 0).wait()
            out.append((name, t))
        return out


def checksums(model: torch.nn.Module, names: list[str] | None) -> dict[str, Any]:
    """Per-tensor hashes of the weights as served (all of them when `names` is None), and every tensor's
    dtype (a model may keep some modules in another dtype than the rest)."""
    from rlx.transport.wire import tensor_hash

    state = model.state_dict(keep_vars=True)
    unknown = [n for n in (names or []) if n not in state]
    if unknown:
        raise WeightError(f"unknown weight {unknown[0]!r}")
    return {"dtypes": {n: str(t.dtype).removeprefix("torch.") for n, t in state.items()},
            "checksums": {n: tensor_hash(state[n]) for n in (state if names is None else names)}}


def weights_by_name(model: torch.nn.Module, name: str, truncate_size: int = 100) -> list[Any]:
    state = model.state_dict(keep_vars=True)
    if name not in state:
        raise WeightError(f"unknown weight {name!r}")
    return state[name].detach().float().flatten()[:truncate_size].cpu().tolist()
