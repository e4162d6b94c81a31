"""Checking after a push that every engine reports the new version and serves the values sent.

The sender keeps the first few values of every tensor it sent (`Fingerprints`), so
no check needs a second copy of the model. What each engine can be asked decides the check, per engine:

* rlx's ``/weights_checksum`` (the embedded engine): hashes by HF name in the dtype the engine holds,
  compared exactly: of the first values of a few tensors spread over the push (``sample``), or of every
  whole tensor (``full``, hashed by the sender as the tensors stream by);
* ``/get_weights_by_name`` (SGLang, Llama/Granite/OPT families only): the first rows of a few tensors,
  compared with the values sent at the engine's precision;
* SGLang's ``/weights_checker`` (0.5.23+; hashes of SGLang's own fused, sharded parameters, which a
  trainer cannot recompute): engines with the same layout must hold identical weights, and an engine's
  weights must have changed when the pushed ones did;
* nothing of these (SGLang 0.5.5 serving Qwen, say): the version alone, with a warning once per engine.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlx.types import JSON

from rlx.errors import EngineError, RLXError


class Fingerprints:
    """The first `values` entries of each tensor that went through a push, in order; with `plans` (each
    engine's dtype per tensor), a hash of those first entries in every dtype an engine holds the tensor in,
    and with `full` a hash of each whole tensor too."""

    def __init__(self, values: int = 8, plans: list[dict[str, str]] | None = None, full: bool = False):
        self.values = values
        self.plans = plans or []
        self.full = full
        self.names: list[str] = []
        self.heads: dict[str, Any] = {}
        self.hashes: dict[tuple[str, str], str] = {}
        self.head_hashes: dict[tuple[str, str], str] = {}

    def watch(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass `named` through, remembering each tensor's first values (and hashes)."""
        import torch

        from rlx.transport.payloads import tensor_hash

        for name, t in named:
            self.names.append(name)
            head = t.detach().flatten()[: self.values]
            self.heads[name] = head.float().cpu().clone()
            for dtype in {plan[name] for plan in self.plans if name in plan}:
                self.head_hashes[(name, dtype)] = tensor_hash(head, getattr(torch, dtype))
                if self.full:
                    self.hashes[(name, dtype)] = tensor_hash(t, getattr(torch, dtype))
            yield name, t

    def sample_names(self, k: int = 3) -> list[str]:
        """A few tensors spread over the push (first, middle, last) to check."""
        if not self.names:
            return []
        idx = sorted({0, len(self.names) // 2, len(self.names) - 1})[:k]
        return [self.names[i] for i in idx]


_WARNED: set[tuple[str, str]] = set()
_NO_BY_NAME: set[str] = set()  # engines whose get_weights_by_name answered that it cannot
_LAST_CHECKER: dict[str, tuple[str, str]] = {}  # the last per-engine checksum each engine reported


def _warn_once(url: str, what: str, message: str) -> None:
    if (url, what) not in _WARNED:
        _WARNED.add((url, what))
        print(f"rlx: warning: engine {url} {message}", file=sys.stderr)


async def served_dtypes(engines: list[Any]) -> dict[str, dict[str, str] | None]:
    """Each engine's dtype per tensor, from its checksum route (None where it has no such route)."""

    async def one(engine) -> dict[str, str] | None:
        async with engine.client(timeout_s=60) as c:
            try:
                return (await c.weights_checksum([]))["dtypes"]
            except EngineError as e:
                if e.status in (404, 405):
                    return None
                raise

    return dict(zip((e.url for e in engines), await asyncio.gather(*(one(e) for e in engines)), strict=True))


def _flat_head(rows: JSON, n: int) -> list[float]:
    """The first `n` values of SGLang's get_weights_by_name answer (rows of the first dimension)."""
    out: list[float] = []

    def walk(x: JSON) -> None:
        if len(out) >= n:
            return
        if isinstance(x, list):
            for v in x:
                walk(v)
        else:
            out.append(float(x))

    walk(rows)
    return out[:n]


async def verify(engines: list[Any], prints: Fingerprints, version: int,
                 dtypes: dict[str, dict[str, str] | None] | None = None, full: bool = False) -> None:
    """Every engine reports `version` and holds what was pushed, as far as it can be asked (see above)."""
    import torch

    checks = prints.sample_names()
    dtypes = dtypes or {}
    checker_sums: dict[str, tuple[Any, str]] = {}

    async def by_checksum(c, engine, plan: dict[str, str]) -> None:
        missing = [n for n in prints.names if n not in plan]
        if missing:
            raise RLXError(f"weight sync: engine {engine.url} has no tensor {missing[0]!r} that was sent")
        if full:
            names, want, how = prints.names, prints.hashes, "whole tensors"
            served = (await c.weights_checksum(names))["checksums"]
        else:
            names, want, how = checks, prints.head_hashes, f"first {prints.values} values"
            served = (await c.request("POST", "/weights_checksum", {"names": names, "head": prints.values}))[
                "checksums"]
        wrong = [n for n in names if served.get(n) != want.get((n, plan[n]))]
        if wrong:
            raise RLXError(f"weight sync: engine {engine.url} serves {len(wrong)} of {len(names)} checked tensors "
                           f"that differ from what was sent for version {version} ({how}, compared as the bytes "
                           f"it holds), e.g. {wrong[:3]}")

    async def by_name(c, engine) -> bool:
        for name in checks:
            try:
                rows = await c.get_weights_by_name(name, prints.values)  # rows: enough for the head
            except EngineError as e:
                if e.status == 400 and name == checks[0]:
                    _NO_BY_NAME.add(engine.url)
                    return False
                raise
            want = prints.heads[name]
            served = torch.tensor(_flat_head(rows, len(want)), dtype=torch.float32)
            # Engines may hold bf16: compare at that precision.
            if served.shape != want.shape or not torch.allclose(served, want, rtol=1e-2, atol=1e-3):
                raise RLXError(f"weight sync: engine {engine.url} serves different values for {name!r} "
                               f"after version {version}: {served[:4].tolist()} vs {want[:4].tolist()}")
        return True

    async def by_checker(c, engine) -> bool:
        try:
            out = await c.weights_checker()
        except EngineError as e:
            if e.status in (404, 405):
                return False
            raise
        layout = json.dumps([r.get("parallelism_info") for r in out.get("ranks", [])], sort_keys=True)
        checker_sums[engine.url] = (layout, str(out.get("per_engine_checksum")))
        return True

    async def one(engine) -> None:
        async with engine.client(timeout_s=120) as c:
            got = await c.weight_version()
            if got != str(version):
                raise RLXError(f"weight sync: engine {engine.url} reports weight version {got!r}, expected {version}")
            plan = dtypes.get(engine.url)
            if plan is not None:
                return await by_checksum(c, engine, plan)
            if engine.url not in _NO_BY_NAME and await by_name(c, engine):
                return
            if await by_checker(c, engine):
                _warn_once(engine.url, "checker", "cannot show weights by name; checking with SGLang's "
                                                  "weights_checker that engines agree and that weights changed")
                return
            _warn_once(engine.url, "version", "offers no way to read weights back (no get_weights_by_name for "
                                              "this model, no weights_checker); checking the version only")

    await asyncio.gather(*(one(e) for e in engines))
    _check_agreement(checker_sums, prints, version)


async def verify_adapter(engines: list[Any], name: str, version: int) -> None:
    """After an adapter push: every engine reports `version` and lists adapter `name` among its models (SGLang's
    ``/v1/models`` lists the adapters it serves)."""

    async def one(engine) -> None:
        async with engine.client(timeout_s=120) as c:
            got = await c.weight_version()
            if got != str(version):
                raise RLXError(f"weight sync: engine {engine.url} reports weight version {got!r}, expected {version}")
            from rlx.transport import served_adapters

            served = await served_adapters(c)
            if name not in served:
                raise RLXError(f"weight sync: engine {engine.url} does not serve LoRA adapter {name!r} after version "
                               f"{version} (it serves {sorted(map(str, served))})")

    await asyncio.gather(*(one(e) for e in engines))


def _check_agreement(sums: dict[str, tuple[Any, str]], prints: Fingerprints, version: int) -> None:
    """Engines with one layout hold identical weights; and each engine's weights changed when the pushed
    ones did (a push every engine ignored would otherwise pass)."""
    by_layout: dict[Any, dict[str, str]] = {}
    for url, (layout, checksum) in sums.items():
        by_layout.setdefault(layout, {})[url] = checksum
    for group in by_layout.values():
        if len(set(group.values())) > 1:
            raise RLXError(f"weight sync: engines with the same layout hold different weights after version "
                           f"{version} (SGLang weights_checker): {group}")
    digest = "".join(f"{n}:{prints.heads[n].tolist()}" for n in prints.names)
    for url, (_, checksum) in sums.items():
        before = _LAST_CHECKER.get(url)
        if before is not None and before[0] == checksum and before[1] != digest:
            raise RLXError(f"weight sync: engine {url} holds the same weights as before version {version} "
                           f"although different ones were pushed (SGLang weights_checker)")
        _LAST_CHECKER[url] = (checksum, digest)
