"""Building reward components from config and calling them, sync or async, with a time limit.

A reward's exception, time-out, crash or non-finite score (NaN, inf) never escapes: the sample is marked
FAILED with the reason and the run goes on. Where rewards run (``rollout.scoring.isolation``):

* ``process`` (the default): sync rewards run in up to ``rollout.scoring.workers`` worker processes
  (`RewardProcesses`). A reward that runs past ``scoring.timeout_s`` has its worker killed, one that crashes
  its worker (a segfault, ``os._exit``, the OOM killer) fails only its sample, and a fresh worker takes the
  next sample. Nothing a reward does can stall the event loop, the trainer's calls or the run's exit. The
  reward is pickled once (cloudpickle: a module's classes and functions by reference, a closure made by a
  factory or a class of ``__main__`` by value) and loaded in each worker; what a reward changes on the sample
  or on itself stays in the worker (a reward reports through its result).
* ``thread``: sync rewards run in up to ``scoring.workers`` threads of their own (`RewardThreads`), for a
  reward that cannot be pickled. A hung one keeps its thread (a thread cannot be killed); once all are
  hung, later calls time out waiting for one.

Async rewards (``async def score``; for example a call to a reward-model server) run on the event loop in
either mode, and are cancelled at the time-out.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import inspect
import json
import math
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cloudpickle

from rlx.config import RewardSpec, RolloutConfig
from rlx.errors import RLXError
from rlx.rollout import reward_worker
from rlx.types import RewardResult, Sample, SampleStatus

if TYPE_CHECKING:
    from rlx.plugins import Plugins
    from rlx.protocols import Reward
    from collections.abc import Callable


@dataclass
class BoundReward:
    """A reward instance with its name and weight from config."""

    name: str
    weight: float
    reward: Reward

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.reward.score)


def build_rewards(specs: list[RewardSpec], plugins: Plugins) -> list[BoundReward]:
    return [BoundReward(s.name, s.weight, plugins.build("rewards", s)) for s in specs]


def as_result(value: object, name: str) -> RewardResult:
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RLXError(f"reward {name!r} returned {type(value).__name__}; expected RewardResult or a number")
    return RewardResult(float(value))


class RewardFailed(Exception):
    """A reward that did not return: the message completes "reward 'NAME' ..."."""


def _settle(fut: asyncio.Future, result: object, error: BaseException | None) -> None:
    if fut.done():  # timed out or cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _hand_back(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: object,
               error: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(_settle, fut, result, error)
    except RuntimeError:  # the loop is closed: nobody waits for it
        pass


# -- threads ------------------------------------------------------------------------------------------


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
            if fut.done():  # timed out while it waited for a thread
                continue
            try:
                result, error = fn(arg), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            _hand_back(loop, fut, result, error)

    def run(self, fn: Callable[[Any], object], arg: object) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.jobs.put((loop, fut, fn, arg))
        return fut


_THREADS: dict[int, RewardThreads] = {}  # by size: made on first use, shared by the process's rollouts


def reward_threads(n: int = 8) -> RewardThreads:
    if n not in _THREADS:
        _THREADS[n] = RewardThreads(n)
    return _THREADS[n]


async def call_reward(reward: Reward, sample: Sample, name: str = "?", threads: int = 8) -> RewardResult:
    """Call `reward.score(sample)` in this process, sync or async, and normalise the result."""
    fn = reward.score
    if inspect.iscoroutinefunction(fn):
        value = await fn(sample)
    else:
        value = await reward_threads(threads).run(fn, sample)
        if inspect.isawaitable(value):
            value = await value
    return as_result(value, name)


# -- processes ----------------------------------------------------------------------------------------


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Worker:
    """One worker process (the leader of a process group of its own, so that what a reward starts goes with
    it) and the pipes to it; started on first use and again after it is killed or dies."""

    def __init__(self, index: int):
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.to_fd = self.from_fd = -1
        self.loaded: set[str] = set()  # the reward keys this process has unpickled

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        down_r, down_w = os.pipe()  # parent -> worker
        up_r, up_w = os.pipe()  # worker -> parent
        env = dict(os.environ, **{reward_worker.PATH_ENV: json.dumps(sys.path)})
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlx.rollout.reward_worker", str(down_r), str(up_w), str(os.getpid())],
                pass_fds=(down_r, up_w), env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(down_w)
            os.close(up_r)
            raise
        finally:
            os.close(down_r)
            os.close(up_w)
        self.to_fd, self.from_fd, self.loaded = down_w, up_r, set()

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (what its reward started too); the pipes stay open."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self, kill: bool) -> None:
        """Close the pipes (a worker that reads exits at end of file) and reap the process; `kill`: SIGKILL
        its process group first (a hung or timed-out reward)."""
        if kill:
            self.kill()
        proc, self.proc = self.proc, None
        for fd in (self.to_fd, self.from_fd):
            if fd >= 0:
                os.close(fd)
        self.to_fd = self.from_fd = -1
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _died(self) -> RewardFailed:
        proc = self.proc
        code = proc.wait() if proc is not None else 0
        self.stop(kill=True)  # anything the reward started goes too
        return RewardFailed(f"crashed its worker process ({_exit_reason(code)})")

    def _exchange(self, body: bytes, timeout_s: float, what: str) -> tuple[str, Any]:
        """Send one frame and read the reply within `timeout_s`; the worker is killed on a time-out and
        reaped when it dies (even if something it started still holds its end of the pipe)."""
        try:
            reward_worker.write_frame(self.to_fd, body)
        except BrokenPipeError:
            raise self._died() from None
        poller = select.poll()  # not select(): descriptors may be past 1024 in a busy driver
        poller.register(self.from_fd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not poller.poll(int(min(max(deadline - time.monotonic(), 0), 0.5) * 1000)):
            if self.proc is None or self.proc.poll() is not None:
                raise self._died()
            if time.monotonic() >= deadline:
                self.stop(kill=True)
                raise RewardFailed(f"{what} after {timeout_s:g}s (its worker process was killed)")
        try:
            frame = reward_worker.read_frame(self.from_fd)
        except EOFError:
            frame = None
        if frame is None:
            raise self._died()
        return pickle.loads(frame)

    def call(self, key: str, payload: bytes, sample: Sample, timeout_s: float, load_timeout_s: float) -> Any:
        """Score `sample` with reward `key` in this worker; RewardFailed if it times out (the worker is
        killed), the worker dies, or the reward cannot be loaded. Starting the worker and loading the reward
        into it have a limit of their own (`load_timeout_s`), outside the sample's."""
        try:
            if self.proc is None or self.proc.poll() is not None:
                if self.proc is not None:
                    self.stop(kill=True)
                self.start()
            if key not in self.loaded:
                status, value = self._exchange(pickle.dumps((key, payload, None)), load_timeout_s,
                                               "could not be loaded in its worker process")
                if status != "ok":
                    raise RewardFailed(value)
                self.loaded.add(key)
            status, value = self._exchange(pickle.dumps((key, None, sample)), timeout_s, "timed out")
        except RewardFailed:
            raise
        except BaseException:  # out of step with the worker (a reply may be left in the pipe): start afresh
            self.stop(kill=True)
            raise
        if status == "raised":
            raise RewardFailed(f"raised {value}")
        if status == "failed":
            raise RewardFailed(value)
        return value


class RewardProcesses:
    """Up to `n` worker processes for sync rewards, each served by a thread of this process that sends it
    one sample at a time and enforces the time limit from when the sample is sent (waiting for a free worker
    does not count: a worker is never stuck, so every queued sample gets one). Each serving thread owns its
    worker: it starts it when the pool is made (off the first step's path) and stops it when the pool closes."""

    def __init__(self, n: int, load_timeout_s: float = 300.0):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.payloads: dict[str, bytes] = {}
        self.load_timeout_s = load_timeout_s
        self.workers = [_Worker(i) for i in range(n)]
        self.threads = [threading.Thread(target=self._serve, args=(w,), name=f"rlx-reward-worker-{w.index}",
                                         daemon=True) for w in self.workers]
        self.closed = False
        for t in self.threads:
            t.start()

    def register(self, reward: object) -> str:
        """Pickle `reward` once (a `pickle` error if it cannot be); the key its calls use."""
        payload = cloudpickle.dumps(reward)
        key = hashlib.blake2b(payload, digest_size=16).hexdigest()  # one config's reward loads once per worker
        self.payloads[key] = payload
        return key

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.pid is not None]

    def run(self, key: str, sample: Sample, timeout_s: float) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.jobs.put((loop, fut, key, sample, timeout_s))
        return fut

    def _serve(self, worker: _Worker) -> None:
        try:
            try:  # start at once, so that the first samples do not wait for an interpreter to start
                worker.start()
            except Exception:  # noqa: BLE001 - the first call tries again and reports why
                worker.stop(kill=True)
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                loop, fut, key, sample, timeout_s = job
                if fut.done():  # its caller went away while it waited
                    continue
                try:
                    result = worker.call(key, self.payloads[key], sample, timeout_s, self.load_timeout_s)
                    error = None
                except RewardFailed as e:
                    result, error = None, e
                except Exception as e:  # noqa: BLE001 - e.g. the sample or a result cannot be pickled
                    result, error = None, RewardFailed(f"could not be run in a worker process "
                                                       f"({type(e).__name__}: {e})")
                _hand_back(loop, fut, result, error)
        finally:
            worker.stop(kill=True)

    def close(self) -> None:
        """Stop every worker and its thread: idle threads stop their workers at once; a busy one's worker is
        killed, so its thread sees it die and stops it."""
        if self.closed:
            return
        self.closed = True
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join(timeout=1)
        for w, t in zip(self.workers, self.threads, strict=True):
            if t.is_alive():  # busy with a sample: kill the process, its thread then reaps it and returns
                w.kill()
                t.join(timeout=5)


_PROCESSES: dict[tuple[int, float], RewardProcesses] = {}  # started on first use, shared by the process's rollouts


def reward_processes(n: int = 4, load_timeout_s: float = 300.0) -> RewardProcesses:
    key = (n, load_timeout_s)
    if key not in _PROCESSES or _PROCESSES[key].closed:
        _PROCESSES[key] = RewardProcesses(n, load_timeout_s)
    return _PROCESSES[key]


def shared_worker_pids() -> set[int]:
    """The reward worker processes this process keeps for its whole life (shared by its rollouts)."""
    return {pid for pool in _PROCESSES.values() if not pool.closed for pid in pool.pids()}


@atexit.register
def _close_pools() -> None:
    for pool in _PROCESSES.values():
        pool.close()


# -- scoring ------------------------------------------------------------------------------------------


class Rewards:
    """The rewards of a rollout (or of an eval dataset) and where they run, from ``rollout``'s settings.

    `where` names the config key of the list in errors (``rollout.rewards``, ``eval.datasets[0].rewards``).
    """

    def __init__(self, specs: list[RewardSpec], plugins: Plugins, rc: RolloutConfig, where: str = "rollout.rewards"):
        self.bound = build_rewards(specs, plugins)
        sc = rc.scoring
        self.timeout_s, self.isolation, self.workers, self.load_timeout_s = (sc.timeout_s, sc.isolation, sc.workers,
                                                                             sc.load_timeout_s)
        self.keys: dict[int, str] = {}  # by position in the list: two entries may share a name
        if self.isolation == "process" and any(not b.is_async for b in self.bound):
            pool = self._pool()
            for i, b in enumerate(self.bound):
                if b.is_async:
                    continue
                try:
                    self.keys[i] = pool.register(b.reward)
                except Exception as e:  # noqa: BLE001 - pickle raises many kinds
                    raise RLXError(
                        f"{where}[{i}] ({b.name}): the reward cannot be sent to a reward worker process "
                        f"({type(e).__name__}: {e}); make it picklable (for example, build what cannot be "
                        f"pickled on first use in score()), or set rollout.scoring.isolation: thread") from None

    def _pool(self) -> RewardProcesses:
        return reward_processes(self.workers, self.load_timeout_s)

    def __iter__(self):
        return iter(self.bound)

    def __len__(self) -> int:
        return len(self.bound)

    async def _call(self, i: int, b: BoundReward, sample: Sample) -> RewardResult:
        if i in self.keys:  # a sync reward in a worker process: the pool enforces the time limit
            return as_result(await self._pool().run(self.keys[i], sample, self.timeout_s), b.name)
        try:
            async with asyncio.timeout(self.timeout_s):  # (3.11's wait_for can drop a cancellation: a 2nd Ctrl-C)
                return await call_reward(b.reward, sample, b.name, self.workers)
        except TimeoutError:
            raise RewardFailed(f"timed out after {self.timeout_s:g}s") from None

    async def score(self, sample: Sample) -> Sample:
        """Fill `sample.rewards` and `sample.reward`; on any failure mark the sample FAILED with why."""
        total = 0.0
        for i, b in enumerate(self.bound):
            try:
                result = await self._call(i, b, sample)
            except RewardFailed as e:
                return _fail(sample, f"reward {b.name!r} {e}")
            except Exception as e:  # noqa: BLE001 - the sample fails, the run goes on
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
