"""The reward worker processes on their own: they ignore Ctrl-C (the run handles it), load a reward once,
stop when the pool closes, and die with the process that started them."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from rlx.rollout.rewards import RewardFailed, RewardProcesses
from rlx.types import RewardResult, Sample


class Counts:
    """Says which process scored and how many samples this instance has scored there."""

    def __init__(self):
        self.n = 0

    def score(self, sample):
        self.n += 1
        return RewardResult(float(len(sample.response_ids)), info={"pid": os.getpid(), "n": self.n})


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def sample(n: int) -> Sample:
    return Sample(prompt_ids=[1, 2], response_ids=list(range(n)))


def test_a_worker_loads_the_reward_once_ignores_ctrl_c_and_is_stopped_by_close():
    pool = RewardProcesses(1)
    try:
        key = pool.register(Counts())

        async def score(n):
            return await pool.run(key, sample(n), 30)

        first = asyncio.run(score(3))
        assert first.score == 3.0 and first.info["n"] == 1
        os.kill(first.info["pid"], signal.SIGINT)  # Ctrl-C reaches the whole process group
        second = asyncio.run(score(5))
        assert second.score == 5.0 and second.info == {"pid": first.info["pid"], "n": 2}  # same process, same reward
        assert pool.register(Counts()) == key  # the same reward (config) is the same key: not loaded again
    finally:
        pool.close()
    assert wait_gone(first.info["pid"], 0.1)  # close reaps its workers


def test_a_reward_that_raises_or_returns_what_cannot_be_pickled_leaves_the_worker_serving():
    pool = RewardProcesses(1)
    try:
        key = pool.register(Raises())

        async def score(n):
            try:
                return await pool.run(key, sample(n), 30)
            except RewardFailed as e:
                return str(e)

        assert asyncio.run(score(0)) == "raised ValueError: no tokens"
        assert asyncio.run(score(1)).startswith("returned what cannot be sent back from the worker process (")
        assert asyncio.run(score(2)) == 2.0
        assert len(pool.pids()) == 1
    finally:
        pool.close()


class Raises:
    def score(self, sample):
        if not sample.response_ids:
            raise ValueError("no tokens")
        if len(sample.response_ids) == 1:
            return RewardResult(1.0, info={"f": lambda: 0})
        return 2.0


def test_workers_die_with_the_process_that_started_them(tmp_path):
    """The parent is killed with SIGKILL (no atexit, no close) while both its workers are busy: they go too."""
    script = textwrap.dedent("""
        import asyncio, os, sys, time
        sys.path.insert(0, sys.argv[1])
        from rlx.rollout.rewards import RewardProcesses
        from test_reward_workers import Counts, Sleeps, sample

        pool = RewardProcesses(2)

        async def main():
            print((await pool.run(pool.register(Counts()), sample(1), 30)).info["pid"], flush=True)
            busy = [pool.run(pool.register(Sleeps()), sample(1), 3600) for _ in range(2)]  # both workers
            await asyncio.sleep(3600)

        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, str(Path(__file__).parent)], stdout=subprocess.PIPE,
                            text=True)
    try:
        first = int(proc.stdout.readline())
        deadline = time.monotonic() + 30
        while len(children(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = children(proc.pid)
        assert first in workers and len(workers) == 2
    finally:
        proc.kill()
        proc.wait()
    assert all(wait_gone(pid) for pid in workers)


class Sleeps:
    def score(self, sample):
        time.sleep(3600)


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"rlx.rollout.reward_worker" in \
                    (d / "cmdline").read_bytes():
                out.append(int(d.name))
    return out


class SlowToLoad:
    """Takes 1.5 s to unpickle (as a reward importing a heavy verifier might); scoring is instant."""

    def __init__(self):
        self.state = "some"  # pickle calls __setstate__ only for a non-empty state

    def __setstate__(self, state):
        time.sleep(1.5)
        self.__dict__.update(state)

    def score(self, sample):
        return 1.0


class FailsToLoad:
    def __init__(self):
        self.state = "some"
    def __setstate__(self, state):
        raise ImportError("no module named 'verifier'")

    def score(self, sample):
        return 1.0


class StartsAProgram:
    """Starts a program that would run for an hour (as a code-execution reward might), writes its pid, hangs."""

    def __init__(self, pid_file):
        self.pid_file = pid_file

    def score(self, sample):
        child = subprocess.Popen(["sleep", "3600"])
        Path(self.pid_file).write_text(str(child.pid))
        time.sleep(3600)


def failures(pool, key, n, timeout_s):
    async def go():
        out = []
        for i in range(n):
            try:
                out.append(await pool.run(key, sample(i + 1), timeout_s))
            except RewardFailed as e:
                out.append(str(e))
        return out

    return asyncio.run(go())


def test_starting_a_worker_and_loading_the_reward_do_not_count_against_the_sample_time_limit():
    pool = RewardProcesses(1)
    try:
        assert failures(pool, pool.register(SlowToLoad()), 2, 1.0) == [1.0, 1.0]
    finally:
        pool.close()


def test_a_reward_that_cannot_be_loaded_says_so_for_every_sample():
    pool = RewardProcesses(1)
    try:
        got = failures(pool, pool.register(FailsToLoad()), 2, 30)
        assert got == ["could not be loaded in the worker process (ImportError: no module named 'verifier')"] * 2
    finally:
        pool.close()


def test_a_time_out_kills_what_the_reward_started_too(tmp_path):
    pid_file = tmp_path / "child.pid"
    pool = RewardProcesses(1)
    try:
        got = failures(pool, pool.register(StartsAProgram(str(pid_file))), 1, 1.0)
        assert got == ["timed out after 1s (its worker process was killed)"]
        assert wait_gone(int(pid_file.read_text()), 5)
    finally:
        pool.close()
