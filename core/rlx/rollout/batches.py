"""Where the training loop gets its batches and how it swaps weights: one interface, two modes.

``train.mode: sync`` (`SyncBatches`): each step generates its batch, then the trainer trains while the
engines idle (or release their memory, ``rollout.offload_during_train``), then weights are pushed.

``train.mode: async`` (`AsyncBatches`): the rollout manager streams finished groups into a queue the
whole time while the trainer trains on groups already finished. Choices:

* Staleness is counted in weight versions: a group's lag is the trainer's version minus the oldest
  version behind any of its tokens. Admission keeps lags within bound: at most
  ``(max_staleness - weight_sync.interval + 1) × n_prompts`` groups are running or queued at once (with
  ``max_staleness: 1`` the next batch generates while the trainer trains on this one). A group that
  still lags too far (a long tail of generation time) is regenerated from its prompt (same ids, first
  in line) or dropped (``train.async.stale_groups``); with ``train.async.mask_stale_tokens`` only the tokens past
  the bound lose their loss mask instead.
* Weight swaps (every ``weight_sync.interval`` steps): ``swap: pause`` pauses generation only for
  the push; requests in flight then go on with the new weights, so one sample may hold tokens of
  several versions, each tagged (partial rollout). ``swap: drain`` holds new requests and lets those in
  flight finish on the old weights first, so no sample mixes versions.
* A checkpoint stops the stream: what runs is aborted and kept with its tokens, what is queued is
  saved in order, and both come back first on resume (nothing lost, nothing twice), then the stream
  restarts.
* Rollout errors (a dead engine) surface in `next_batch`, not silently in a background task.

``train.mode: async`` under ``run.deterministic`` (`OneStepOffBatches`): one step off the policy on a fixed
schedule. Step k+1's batch is generated whole, as a sync step's is, while step k trains, with the weights step k-1
left; the push waits for it. Every batch's weights are so fixed by its step, never by timing, and the run repeats
bit for bit; the ``train.async`` knobs, which trade that for throughput, do not apply.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from rlx.config import Config, engines_offload
from rlx.errors import RLXError
from rlx.rollout.manager import RolloutManager
from rlx.types import Group, RolloutBatch

if TYPE_CHECKING:
    from rlx.rollout.engines.fleet import EngineFleet

Push = Callable[[], Awaitable[Any]]
log = logging.getLogger(__name__)


class BatchSource(Protocol):
    """What the training loop needs from a source of batches (`SyncBatches`, `AsyncBatches`, and the
    rollout buffer's `rlx.data.buffer.BufferBatches`)."""

    def start(self) -> None: ...  # begin producing (after any checkpoint state is loaded)
    async def next_batch(self, step: int, version: int) -> RolloutBatch: ...
    async def before_train(self) -> None: ...
    async def after_train(self) -> None: ...
    async def swap(self, push: Push) -> None: ...  # push weights, handling requests in flight
    async def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    async def rewind(self, state: dict[str, Any]) -> None: ...  # back to a checkpoint while running
    async def close(self) -> None: ...


class SyncBatches:
    def __init__(self, cfg: Config, manager: RolloutManager, fleet: EngineFleet):
        self.manager = manager
        self.fleet = fleet
        self.offload = engines_offload(cfg)
        self.released: list[Any] = []  # engines whose memory was released for this train step

    def start(self) -> None:
        pass

    async def next_batch(self, step: int, version: int) -> RolloutBatch:
        return await self.manager.next_batch(step, version)

    async def before_train(self) -> None:
        if self.offload:  # SGLang releases only an idle server (and its scheduler dies otherwise): pause first
            self.released = list(self.fleet.serving)
            await self.fleet.for_each(lambda c: c.pause(mode="abort"), self.released)
            await self.fleet.for_each(lambda c: c.release_memory(), self.released)

    async def after_train(self) -> None:
        if self.offload:  # only those released (an engine restarted meanwhile holds its memory, unpaused)
            back = [e for e in self.released if e.state == "serving"]
            await self.fleet.for_each(lambda c: c.resume_memory(), back)
            await self.fleet.for_each(lambda c: c.resume(), back)

    async def swap(self, push: Push) -> None:
        await push()

    async def state_dict(self) -> dict[str, Any]:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state)

    async def rewind(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state)

    async def close(self) -> None:
        pass


class OneStepOffBatches(SyncBatches):
    """Async mode under run.deterministic (module docstring): the next batch generates while this one trains."""

    def __init__(self, cfg: Config, manager: RolloutManager, fleet: EngineFleet):
        super().__init__(cfg, manager, fleet)
        self.ahead: asyncio.Task[RolloutBatch] | None = None  # the next step's batch, generating
        self.restored: RolloutBatch | None = None  # the next step's batch, from a checkpoint

    async def next_batch(self, step: int, version: int) -> RolloutBatch:
        if self.restored is not None:
            batch, self.restored = self.restored, None
        elif self.ahead is not None:
            batch, self.ahead = await self.ahead, None
        else:  # the run's first step
            batch = await self.manager.next_batch(step, version)
        # on the weights the engines hold now (`version`): the push after this step waits for it (`swap`)
        self.ahead = asyncio.create_task(self.manager.next_batch(step + 1, version))
        lag = float(version - batch.weight_version)  # 1 but at the first step (as async mode's metrics name it)
        batch.metrics.update({"async/staleness_mean": lag, "async/staleness_max": lag})
        return batch

    async def before_train(self) -> None:  # async mode: the engines generate the next batch while this one trains
        pass

    async def after_train(self) -> None:
        pass

    async def _next(self) -> RolloutBatch | None:
        """The next step's batch, whole (None before the first step)."""
        if self.ahead is not None:
            self.restored, self.ahead = await self.ahead, None
        return self.restored

    async def swap(self, push: Push) -> None:
        await self._next()
        await push()

    async def state_dict(self) -> dict[str, Any]:
        ahead = await self._next()
        state = self.manager.state_dict()
        if ahead is not None:
            state["ahead"] = {"step": ahead.step, "weight_version": ahead.weight_version, "metrics": ahead.metrics,
                              "groups": [g.to_dict() for g in ahead.groups]}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state)
        a = state.get("ahead")
        self.restored = None if a is None else RolloutBatch(
            a["step"], [Group.from_dict(g) for g in a["groups"]], a["weight_version"], a["metrics"])

    async def rewind(self, state: dict[str, Any]) -> None:
        await self.close()
        self.load_state_dict(state)

    async def close(self) -> None:
        task, self.ahead = self.ahead, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class AsyncBatches:
    def __init__(self, cfg: Config, manager: RolloutManager, fleet: EngineFleet):
        self.cfg = cfg
        self.tc = cfg.train
        self.ac = cfg.train.async_
        self.rc = cfg.rollout
        self.manager = manager
        self.fleet = fleet
        self.queue: asyncio.Queue[Group] = asyncio.Queue()  # bounded by admission, not by size
        self.queued: list[Group] = []  # restored from a checkpoint: served before the queue
        self.stop = asyncio.Event()  # a new one per start
        self.room = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.capacity = (self.ac.max_staleness - self.cfg.weight_sync.interval + 1) * self.rc.n_prompts

    def start(self) -> None:
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.manager.run_stream(self.queue, self.stop, self.capacity, self.room))

    async def _halt(self) -> None:
        """Stop the stream: in-flight groups are aborted into `manager.pending`, queued ones into `queued`."""
        if self.task is None:
            return
        self.stop.set()
        task, self.task = self.task, None
        try:
            await task
        finally:
            while not self.queue.empty():
                self.queued.append(self.queue.get_nowait())

    async def _get(self) -> Group:
        if self.queued:
            return self.queued.pop(0)
        assert self.task is not None, "start() first"
        stream = self.task
        get = asyncio.ensure_future(self.queue.get())
        await asyncio.wait({get, stream}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            self.room.set()
            return get.result()
        get.cancel()
        stream.result()  # raises what stopped the stream (e.g. a dead engine)
        raise RLXError("the rollout stream stopped without an error")

    async def next_batch(self, step: int, version: int) -> RolloutBatch:
        t0 = time.monotonic()
        kept: list[Group] = []
        lags: list[int] = []
        stale = masked = 0
        filtered_before = self.manager.stream_filtered
        while len(kept) < self.rc.n_prompts:
            group = await self._get()
            oldest = group.oldest_version
            lag = 0 if oldest is None else version - oldest
            too_old = lag > self.ac.max_staleness
            if too_old and self.ac.mask_stale_tokens:
                masked += self._mask_stale(group, version)
                too_old = not any(any(s.loss_mask) for s in group.trainable)  # nothing left to learn from
            if too_old:
                stale += 1
                if self.ac.stale_groups == "regenerate":
                    self.manager.regenerate(group)
                continue
            kept.append(group)
            lags.append(lag)
        kept.sort(key=lambda g: g.group_id)
        batch = RolloutBatch(step, kept, version)
        filtered = self.manager.stream_filtered - filtered_before
        batch.metrics.update(self.manager.batch_metrics(batch, filtered, time.monotonic() - t0))
        batch.metrics.update({
            "async/staleness_mean": sum(lags) / len(lags),
            "async/staleness_max": float(max(lags)),
            "async/stale_groups": float(stale),
            "async/masked_tokens": float(masked),
            "async/queued_groups": float(self.queue.qsize() + len(self.queued)),
        })
        return batch

    def _mask_stale(self, group: Group, version: int) -> int:
        """Zero the loss mask of tokens older than the staleness bound; returns how many were masked."""
        oldest_ok = version - self.ac.max_staleness
        n = 0
        for s in group.samples:
            masked = 0
            for i, v in enumerate(s.token_versions):
                if v < oldest_ok and s.loss_mask[i]:
                    s.loss_mask[i] = 0
                    masked += 1
            if masked:  # the trainer's TITO count compares sampled tokens with trained + masked ones
                s.metadata["stale_masked_tokens"] = s.metadata.get("stale_masked_tokens", 0) + masked
            n += masked
        return n

    async def before_train(self) -> None:
        pass

    async def after_train(self) -> None:
        pass

    async def swap(self, push: Push) -> None:
        if self.ac.swap == "pause":
            await self.fleet.for_each(lambda c: c.pause(mode="retract"))
            try:
                await push()
            finally:
                await self.fleet.for_each(lambda c: c.resume())
        else:
            gate = self.manager.ctx.gate
            await gate.drain()
            try:
                await push()
            finally:
                gate.reopen()

    async def state_dict(self) -> dict[str, Any]:
        await self._halt()
        state = self.manager.state_dict()
        state["queued"] = [g.to_dict() for g in self.queued]
        self.start()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state)
        self.queued = [Group.from_dict(g) for g in state.get("queued", [])]

    async def rewind(self, state: dict[str, Any]) -> None:
        """Back to a checkpoint's state: what streamed since is dropped (its ids come again from the
        checkpoint's counters, as after a resume)."""
        await self._halt()
        self.queued = []
        self.load_state_dict(state)
        self.start()

    async def close(self) -> None:
        try:
            await self._halt()
        except Exception as e:  # the run is over (or failing for its own reason): say so, do not mask it
            log.warning("stopping the rollout stream: %s", e)


def batch_source(cfg: Config, manager: RolloutManager, fleet: EngineFleet) -> BatchSource:
    if cfg.train.mode == "sync":
        return SyncBatches(cfg, manager, fleet)
    return OneStepOffBatches(cfg, manager, fleet) if cfg.run.deterministic else AsyncBatches(cfg, manager, fleet)
