"""Checking after a push that every engine reports the new version and serves the values sent.

The sender keeps the first few values of every tensor it sent (`rlx.transport.sender.Fingerprints`), so
the ``sample`` check needs no second copy of the model; it asks each engine for a few tensors spread over what it sent. The
``full`` check also hashes every tensor as it streams by, in the dtype each engine serves, and compares
the engines' own per-tensor hashes (the embedded engine's ``/weights_checksum``); an engine without such
a route gets the sample check and a warning, once.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, Any

from rlx.errors import RLXError
from rlx.rollout.engines.protocol import EngineError

if TYPE_CHECKING:
    from rlx.transport.sender import Fingerprints

_WARNED: set[str] = set()


async def served_dtypes(engines: list[Any]) -> dict[str, dict[str, str] | None]:
    """Each engine's dtype per tensor, from its checksum route (None where it has no such route)."""

    async def one(engine) -> dict[str, str] | None:
        async with engine.client(timeout_s=60) as c:
            try:
                return (await c.weights_checksum([]))["dtypes"]
            except EngineError as e:
                if e.status in (404, 405):
                    if engine.url not in _WARNED:
                        _WARNED.add(engine.url)
                        print(f"rlx: warning: engine {engine.url} serves no per-tensor checksums; "
                              f"train.verify_weights: full falls back to sample checks there", file=sys.stderr)
                    return None
                raise

    return dict(zip((e.url for e in engines), await asyncio.gather(*(one(e) for e in engines)), strict=True))


async def verify(engines: list[Any], prints: Fingerprints, version: int,
                 dtypes: dict[str, dict[str, str] | None] | None = None) -> None:
    """Every engine reports `version` and holds the pushed values of a few tensors; where `dtypes` gives an
    engine's dtype per tensor (a full check), its hash of every pushed tensor equals the sender's."""
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
            plan = (dtypes or {}).get(engine.url)
            if plan is None:
                return
            missing = [n for n in prints.names if n not in plan]
            if missing:
                raise RLXError(f"weight sync: engine {engine.url} has no tensor {missing[0]!r} that was sent")
            served_hashes = (await c.weights_checksum(prints.names))["checksums"]
            wrong = [n for n in prints.names if served_hashes.get(n) != prints.hashes.get((n, plan[n]))]
            if wrong:
                raise RLXError(f"weight sync: engine {engine.url} serves {len(wrong)} of {len(prints.names)} tensors "
                               f"that differ from what was sent for version {version} (compared as the bytes "
                               f"it holds), e.g. {wrong[:3]}")

    await asyncio.gather(*(one(e) for e in engines))
