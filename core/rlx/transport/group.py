"""The weight-update group between the trainer and the engines, laid out as SGLang lays out its side.

SGLang's engines join with ``init_custom_process_group(backend, "tcp://addr:port", world_size,
rank=rank_offset + tp_rank, group_name)``: a client of the trainer's ``TCPStore``, whose keys live under
``PrefixStore(group_name)``, then torch's own ``"{group_name}/"`` and per-device (``"cpu/"`` for gloo,
``"cuda/"`` for NCCL) prefixes. The trainer is rank 0 and must use the same key chain, or it waits forever
on keys nobody writes. Every TP rank of every engine is one member, so an engine with TP size t takes t
consecutive ranks; the world is 1 + the sum of the engines' TP sizes.

Both ends here build the process group object directly (not ``init_process_group``), so neither side
gives up its default group, and gloo can be bound to the address this side is reached at (across hosts
the hostname's address is often loopback). `tests/integration/test_sglang_code.py` joins SGLang's own
function on the engine side to this trainer side.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

DEFAULT_GROUP = "weight_update_group"


def engine_ranks(tp_sizes: list[int]) -> tuple[list[int], int]:
    """Each engine's ``rank_offset`` (its first TP rank's rank in the group) and the group's world size,
    for engines with these TP sizes; the trainer is rank 0."""
    offsets, next_rank = [], 1
    for tp in tp_sizes:
        if tp < 1:
            raise ValueError(f"an engine's TP size must be >= 1, got {tp}")
        offsets.append(next_rank)
        next_rank += tp
    return offsets, next_rank


def device_of(backend: str) -> str:
    if backend == "gloo":
        return "cpu"
    if backend == "nccl":
        return "cuda"
    raise ValueError(f"unknown backend {backend!r}; use gloo or nccl")


def group_store(store: dist.Store, group_name: str, backend: str) -> dist.Store:
    """The store view SGLang's group of this name and backend reads and writes."""
    import torch.distributed as dist

    return dist.PrefixStore(f"{device_of(backend)}/",
                            dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


def open_group(host: str, port: int, rank: int, world_size: int, group_name: str = DEFAULT_GROUP,
               backend: str = "gloo", timeout_s: float = 1800, bind: str | None = None) -> Any:
    """Join (rank > 0) or host (rank 0: the store's server) the weight-update group; returns its process
    group (``broadcast(tensor, 0)``). Rank 0 returns once every member joined. `bind`: the local address
    gloo uses (default: `host` for rank 0, the hostname's address otherwise)."""
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
                          multi_tenant=True)
    prefixed = group_store(store, group_name, backend)
    pg: Any  # torch's ProcessGroupGloo or ProcessGroupNCCL (they share no type in torch's stubs)
    if backend == "gloo":
        from rlx.net import gloo_options

        opts = gloo_options(bind if bind is not None else host if rank == 0 else None)
        opts._timeout = timeout
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    else:
        device_of(backend)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        torch.cuda.current_device()
    return pg
