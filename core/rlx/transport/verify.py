"""Checking after a push that every engine reports the new version and serves the values sent.

The sender keeps the first few values of every tensor it sent (`Fingerprints`), so verification needs
no second copy of the model; it then asks each engine for a few tensors spread over what it sent.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlx.errors import RLXError


class Fingerprints:
    """The first `values` entries of each tensor that went through a push, in order."""

    def __init__(self, values: int = 8):
        self.values = values
        self.names: list[str] = []
        self.heads: dict[str, Any] = {}

    def watch(self, named: Any):
        """Pass `named` through, remembering each tensor's first values."""
        for name, t in named:
            self.names.append(name)
            self.heads[name] = t.detach().flatten()[: self.values].float().cpu().clone()
            yield name, t

    def sample_names(self, k: int = 3) -> list[str]:
        """A few tensors spread over the push (first, middle, last) to check."""
        if not self.names:
            return []
        idx = sorted({0, len(self.names) // 2, len(self.names) - 1})[:k]
        return [self.names[i] for i in idx]


async def verify(engines: list[Any], prints: Fingerprints, version: int) -> None:
    """Every engine reports `version` and holds the pushed values of a few tensors."""
    import torch

    checks = prints.sample_names()

    async def one(engine) -> None:
        async with engine.client(timeout_s=120) as c:
            got = await c.weight_version()
            if got != str(version):
                raise RLXError(f"weight sync: engine {engine.url} reports weight version {got!r}, expected {version}")
            for name in checks:
                served = torch.tensor(await c.get_weights_by_name(name, prints.values), dtype=torch.float32)
                want = prints.heads[name]
                # Engines may hold bf16: compare at that precision.
                if served.shape != want.shape or not torch.allclose(served, want, rtol=1e-2, atol=1e-3):
                    raise RLXError(f"weight sync: engine {engine.url} serves different values for {name!r} "
                                   f"after version {version}: {served[:4].tolist()} vs {want[:4].tolist()}")

    await asyncio.gather(*(one(e) for e in engines))
