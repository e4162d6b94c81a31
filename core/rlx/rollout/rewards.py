"""Building reward components from config and calling them, sync or async, with a time limit.

A reward's exception, time-out or non-finite score (NaN, inf) never escapes: the sample is marked FAILED
with the reason and the run goes on. Sync rewards run in threads of their own pool
(``rollout.reward_threads``), so a slow or hung reward neither stalls the event loop nor takes the threads
that trainer and engine calls use; a hung one keeps its thread, and once all are hung new calls time out.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import queue
import threading
from dataclasses import dataclass
from typing import Any

from rlx.config import RewardSpec
from rlx.errors import RLXError
from rlx.types import RewardResult, Sample, SampleStatus


@dataclass
class BoundReward:
    """A reward instance with its name and weight from config."""

    name: str
    weight: float
    reward: Any


def build_rewards(specs: list[RewardSpec], plugins: Any) -> list[BoundReward]:
    return [BoundReward(s.name, s.weight, plugins.build("rewards", s)) for s in specs]


def as_result(value: Any, name: str) -> RewardResult:
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RLXError(f"reward {name!r} returned {type(value).__name__}; expected RewardResult or a number")
    return RewardResult(float(value))


class RewardThreads:
    """Daemon threads for sync rewards. A hung reward keeps its thread, but neither trainer or engine calls
    (asyncio's default pool) nor the process's exit wait for it (`concurrent.futures` threads are joined at
    exit)."""

    def __init__(self, n: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._work, name=f"rlx-reward-{i}", daemon=True).start()

    def _work(self) -> None:
        while True:
            loop, fut, fn, arg = self.jobs.get()
            try:
                result, error = fn(arg), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # the loop is closed: nobody waits for it
                pass

    def run(self, fn: Any, arg: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.jobs.put((loop, fut, fn, arg))
        return fut


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # timed out and cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


_POOLS: dict[int, RewardThreads] = {}  # by size: made on first use, shared by the process's rollouts


def reward_pool(threads: int = 8) -> RewardThreads:
    if threads not in _POOLS:
        _POOLS[threads] = RewardThreads(threads)
    return _POOLS[threads]


async def call_reward(reward: Any, sample: Sample, name: str = "?", threads: int = 8) -> RewardResult:
    """Call `reward.score(sample)`, sync or async, and normalise the result."""
    fn = reward.score
    if inspect.iscoroutinefunction(fn):
        value = await fn(sample)
    else:
        value = await reward_pool(threads).run(fn, sample)
        if inspect.isawaitable(value):
            value = await value
    return as_result(value, name)


async def score_sample(sample: Sample, rewards: list[BoundReward], timeout_s: float | None,
                       threads: int = 8) -> Sample:
    """Fill `sample.rewards` and `sample.reward`; on any failure mark the sample FAILED with why."""
    total = 0.0
    for b in rewards:
        try:
            result = await asyncio.wait_for(call_reward(b.reward, sample, b.name, threads), timeout_s)
        except TimeoutError:
            return _fail(sample, f"reward {b.name!r} timed out after {timeout_s}s")
        except Exception as e:
            return _fail(sample, f"reward {b.name!r} raised {type(e).__name__}: {e}")
        if not math.isfinite(result.score):
            return _fail(sample, f"reward {b.name!r} returned {result.score} (not a finite number)")
        sample.rewards[b.name] = result
        total += b.weight * result.score
    sample.reward = total
    return sample


def _fail(sample: Sample, why: str) -> Sample:
    sample.status = SampleStatus.FAILED
    sample.error = why
    sample.reward = None
    return sample
