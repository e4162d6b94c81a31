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


_POOL: list[Any] = []  # the sync rewards' thread pool, made on first use


def reward_pool(threads: int = 8) -> Any:
    from concurrent.futures import ThreadPoolExecutor

    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rlx-reward"))
    return _POOL[0]


async def call_reward(reward: Any, sample: Sample, name: str = "?", threads: int = 8) -> RewardResult:
    """Call `reward.score(sample)`, sync or async, and normalise the result."""
    fn = reward.score
    if inspect.iscoroutinefunction(fn):
        value = await fn(sample)
    else:
        value = await asyncio.get_running_loop().run_in_executor(reward_pool(threads), fn, sample)
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
