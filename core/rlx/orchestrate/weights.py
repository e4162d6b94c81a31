"""The weight-sync coordinator: the trainer's weights, the engines that get them, one trainer call at a time."""

from __future__ import annotations

import asyncio
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlx.orchestrate.ranks import TrainerGroup
    from rlx.rollout.context import ServedAdapter
    from rlx.rollout.engines.fleet import EngineFleet
    from rlx.types import RolloutBatch


class Weights:
    """The trainer's weights and the engines that get them. One trainer call at a time (a train step, a
    push, a catch-up: a restarted engine may need weights while the trainer trains, in async mode). The
    transport follows the serving engines: set up again when one was taken out or came back. A push that
    failed because an engine failed (it fails a health probe now) is done again without that engine."""

    def __init__(self, trainer: TrainerGroup, fleet: EngineFleet, out: Path, version: int = 0,
                 adapters: dict[str | None, ServedAdapter] | None = None):
        """`adapters` (``train.lora.push: adapter``, those ``on``): what requests name, by adapter (None: the one
        adapter; multi-LoRA's by name), each moved to its adapter pushed; the engines unload the older ones once no
        request uses them."""
        self.trainer, self.fleet, self.out = trainer, fleet, str(out)
        self.adapters = {k: a for k, a in (adapters or {}).items() if a.on}
        self.unloads: set[asyncio.Task] = set()
        self.ready = asyncio.Event()  # clear while the trainers restart: an engine back waits for their weights
        self.ready.set()
        self.lock = asyncio.Lock()
        self.version = version  # the trainer's policy version: what a catch-up pushes
        self.urls: list[str] | None = None  # where the transport points now
        if fleet.health is not None:
            fleet.health.joins = asyncio.Queue()  # engines back: `joins` brings each to these weights

    async def _point(self, engines: list[Any]) -> None:
        urls = [e.url for e in engines]
        if urls and urls != self.urls:
            await asyncio.to_thread(self.trainer.setup_transport, urls, self.out)
            self.urls = urls

    async def setup(self) -> None:
        async with self.lock:
            await self._point(self.fleet.weight_targets)

    async def train_step(self, batch: RolloutBatch) -> dict[str, float | None]:
        """One train step on `batch` (its policy version is the next), between the pushes and catch-ups."""
        async with self.lock:
            metrics = await asyncio.to_thread(self.trainer.train_step, batch)
            self.version += 1
            return metrics

    async def push(self, version: int) -> int:
        """Push `version` to the serving engines; the bytes sent (once, however many engines got them)."""
        async with self.lock:
            for attempt in range(3):
                try:
                    await self._point(self.fleet.weight_targets)
                    if not self.fleet.weight_targets:  # every engine is out (each gets the weights when it comes
                        return 0  # back), or none runs (rollout.source: replay)
                    if not self.adapters:
                        return await asyncio.to_thread(self.trainer.push_weights, version)
                    return await self._push_adapters(version)
                except Exception as e:
                    health = self.fleet.health
                    if health is None or attempt == 2:
                        raise
                    await health.settle()  # an engine that failed the push fails its probe: taken out
                    if [x.url for x in self.fleet.weight_targets] == self.urls:
                        raise  # every engine still serves: not an engine failure
                    self.urls = None  # set up again, for the engines that serve
                    print(f"rlx: weight push of version {version} failed ({e}); pushing again to the engines "
                          f"that serve", file=sys.stderr, flush=True)
        raise AssertionError("unreachable: the third attempt returns or raises")

    async def _push_adapters(self, version: int) -> int:
        """Each adapter of `version`, under a name of its own no engine has had; requests name them from then on."""
        names = {key: adapter_name(version, key) for key in self.adapters}
        try:
            sent = await asyncio.to_thread(self.trainer.push_weights, version, names)
        except BaseException:
            for key, name in names.items():
                self._unload(key, name)  # (some engines may have some)
            raise
        for key, name in names.items():
            self._serve(key, name, version)
        return sent

    def _serve(self, key: str | None, name: str, version: int) -> None:
        """After adapter `key`'s `name` of `version` was pushed: its requests name it from now on, and the engines
        unload the one before once no request uses it (in the background: a paused engine holds its requests)."""
        adapter = self.adapters[key]
        old, adapter.name, adapter.version = adapter.name, name, version
        if old is not None and old != name:
            self._unload(key, old)

    def _unload(self, key: str | None, name: str) -> None:
        async def unload() -> None:
            await self.adapters[key].unused(name)

            async def one(c):
                try:
                    await c.unload_lora_adapter(name)
                except Exception as e:  # noqa: BLE001 - an engine that has not got it (restarted, or a failed push)
                    print(f"rlx: unloading LoRA adapter {name} from {c.base_url}: {e}", file=sys.stderr, flush=True)

            await self.fleet.for_each(one, self.fleet.weight_targets)

        self._background(unload())

    def _tidy(self, engine: Any) -> None:
        """Unload from an engine back what it still holds of the adapters unloaded while it was out."""
        async def tidy() -> None:
            from rlx.transport import served_adapters

            used = {n for a in self.adapters.values() for n in (a.name, *a.users)}
            async with engine.client() as c:
                for name in await served_adapters(c) - used:
                    await c.unload_lora_adapter(name)

        self._background(tidy())

    def _background(self, work: Any) -> None:
        """Run `work` (an unload) beside the run; `close` cancels what is left of it."""
        task = asyncio.create_task(work)
        self.unloads.add(task)
        task.add_done_callback(self.unloads.discard)

    async def close(self) -> None:
        """Cancel the adapters' unloads still under way (the engines stop with the run)."""
        for task in list(self.unloads):
            task.cancel()
        await asyncio.gather(*self.unloads, return_exceptions=True)

    async def joins(self) -> None:
        """For the run's life: bring each engine the fleet's health has back (restarted or answering again, not
        yet serving) to the trainer's current weights and admit it before the next train step or push can change
        those weights; its future says it is in, or why not. The transport is set up again even where the
        engine's address is one it points to (an engine back at its old address is a new process: what the
        transport learned of the old one, such as its tensor dtypes, is gone)."""
        health = self.fleet.health
        while True:
            engine, done = await health.joins.get()
            try:
                await self.ready.wait()
                async with self.lock:
                    self.urls = None
                    await self._point([engine])
                    served = {k: a.name for k, a in self.adapters.items() if a.name is not None}
                    if not self.adapters:
                        await asyncio.to_thread(self.trainer.push_weights, self.version)
                    elif (any(a.version < self.version for a in self.adapters.values())
                          and not self.fleet.weight_targets):
                        # every engine was out at the pushes since: it gets the trainer's adapters, requests name them
                        await self._push_adapters(self.version)
                    elif served:  # the adapters requests name (none yet: the base model)
                        version = max(a.version for a in self.adapters.values())  # (pushed together)
                        await asyncio.to_thread(self.trainer.push_weights, version, served, True)
                    await health.admit(engine)
                    if self.adapters:
                        self._tidy(engine)
            except Exception as e:  # noqa: BLE001 - the engine stays out: its recovery says why
                if not done.done():
                    done.set_exception(e)
            else:
                if not done.done():
                    done.set_result(None)

    def metrics(self) -> dict[str, float]:
        return self.fleet.health.metrics() if self.fleet.health is not None else {}


def adapter_name(version: int, key: str | None = None) -> str:
    """A name for the actor's adapter `key` (None: the one adapter) of `version` that no engine has loaded before (one
    per push: a retried push, a restarted run or an engine kept across a resume never meets its own name)."""
    return f"{key or 'actor'}-v{version}-{secrets.token_hex(3)}"
