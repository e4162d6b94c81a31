"""Moving trainer weights into the engines, and checking that the engines serve them.

A transport is a component registered through ``register_transports``: ``name``, an optional
pydantic ``Config``, ``async setup(engines)``, ``async push(named, version, engines)`` and
``async close()``. ``named`` is a list of ``(hf_name, tensor)`` with full (TP-gathered) tensors.
After every push `verify` asks each engine for its weight version and the first values of a few
tensors; a mismatch is an error, never a silent stale policy.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlx.errors import RLXError


def sample_names(named: list[tuple[str, Any]], k: int = 3) -> list[str]:
    """A few tensors spread over the model (first, middle, last) to checksum."""
    if not named:
        return []
    idx = sorted({0, len(named) // 2, len(named) - 1})[:k]
    return [named[i][0] for i in idx]


async def verify(engines: list[Any], named: list[tuple[str, Any]], version: int, values: int = 8) -> None:
    """Every engine reports `version` and holds the pushed values of a few tensors."""
    import torch

    by_name = dict(named)
    checks = sample_names(named)

    async def one(engine) -> None:
        async with engine.client(timeout_s=120) as c:
            got = await c.weight_version()
            if got != str(version):
                raise RLXError(f"weight sync: engine {engine.url} reports weight version {got!r}, expected {version}")
            for name in checks:
                served = torch.tensor(await c.get_weights_by_name(name, values), dtype=torch.float32)
                want = by_name[name].detach().float().flatten()[:values].cpu()
                # Engines may hold bf16: compare at that precision.
                if served.shape != want.shape or not torch.allclose(served, want, rtol=1e-2, atol=1e-3):
                    raise RLXError(f"weight sync: engine {engine.url} serves different values for {name!r} "
                                   f"after version {version}: {served[:4].tolist()} vs {want[:4].tolist()}")

    await asyncio.gather(*(one(e) for e in engines))


def buckets(named: list[tuple[str, Any]], bucket_bytes: int) -> list[list[tuple[str, Any]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each (a larger tensor goes alone)."""
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return [b for b in out if b]
