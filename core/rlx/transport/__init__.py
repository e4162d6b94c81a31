"""Weight sync: moving the trainer's weights into the engines, and checking that they serve them.

This package is the one home of weight sync: the transport contract and its context (here), bucketing
(`buckets`), the tensor wire format (`payloads`), the trainer side of a push (`sender`), verification
(`verify`) and the built-in transports (`builtin`). Transports are components (``register_transports``; the
delta transport is a plugin of its own).

A push, as the trainer runs it (`sender.WeightSender`):

1. every sending rank (one per pipeline stage: data-parallel rank 0, tensor-parallel rank 0) calls
   ``await transport.send(named, version, ctx)`` with its stage's HF tensors, streamed one at a time
   (``named`` is an iterator: a transport must not hold more than it needs, e.g. one bucket). The
   stages send one after another;
2. after every sender returned (the trainer ranks agree that all succeeded), sender 0 calls
   ``await transport.commit(version, ctx)``, which makes the engines serve `version` (a reload from
   disk, or setting the version once all tensors are in);
3. each sender checks that the engines report `version` and serve the values it sent (`verify`).

``setup(ctx)`` runs once on every sender before the first push (to join a broadcast group, say) and
``close()`` once at the end.

With LoRA adapters pushed instead of weights (``ctx.adapter``, `rlx.protocols.Adapter`), sender 0 alone sends the whole
adapter, and the commit loads it on the engines under its name for the version (`serve_adapter`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from typing import Any

from rlx.protocols import Adapter as Adapter  # re-exported: defined beside its contract
from rlx.protocols import TransportContext as TransportContext


def buckets(named: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each (a larger tensor goes alone), taken
    lazily from `named` so that at most one bucket is held at a time."""
    out: list[tuple[str, Any]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out and size + n > bucket_bytes:
            yield out
            out, size = [], 0
        out.append((name, t))
        size += n
    if out:
        yield out


class update_sessions:  # noqa: N801  (used as `async with update_sessions(engines)`)
    """SGLang's weight-update session on every engine for the duration of one send: a transport that sends
    tensors (``update_weights_from_tensor``) or broadcasts (``update_weights_from_distributed``) does it
    inside ``async with update_sessions(ctx.engines):``. SGLang 0.5.23 refuses those updates outside one;
    engines without sessions (0.5.5) need none."""

    def __init__(self, engines):
        self.engines = engines
        self.opened: list = []

    async def __aenter__(self):
        async def begin(e):
            async with e.client() as c:
                if await c.begin_weight_update():
                    self.opened.append(e)

        results = await asyncio.gather(*(begin(e) for e in self.engines), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # `async with` does not exit what failed to enter: close the sessions that did open here
            await self.__aexit__(type(failed[0]), failed[0], failed[0].__traceback__)
            raise failed[0]
        return self

    async def __aexit__(self, *exc):
        async def end(e):
            async with e.client() as c:
                await c.end_weight_update()

        results = await asyncio.gather(*(end(e) for e in self.opened), return_exceptions=True)
        if exc[0] is None:
            for r in results:
                if isinstance(r, BaseException):
                    raise r


async def serve_adapter(engines, name: str, version: int, load) -> None:
    """The commit of an adapter push: each engine loads adapter `name` (``await load(client, engine)``) unless it serves
    it already (an engine that answers again after a failure), then serves `version`."""
    async def one(e):
        async with e.client() as c:
            if name not in await served_adapters(c):
                await load(c, e)
            await c.update_weight_version(str(version))

    await asyncio.gather(*(one(e) for e in engines))


async def served_adapters(client) -> set[str]:
    """The LoRA adapters an engine serves, as its ``/v1/models`` lists them beside the base model (SGLang's way)."""
    return {m.get("id") for m in (await client.request("GET", "/v1/models")).get("data", []) if m.get("parent")}
