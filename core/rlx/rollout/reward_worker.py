"""A reward worker process: scores samples with sync rewards sent to it by `rlx.rollout.rewards.RewardProcesses`.

Run as ``python -m rlx.rollout.reward_worker READ_FD WRITE_FD PARENT_PID``. It reads frames (an 8-byte
big-endian length, then a pickle) of ``(key, payload, sample)`` from READ_FD: either a pickled reward to load
under `key` (`sample` None), or a sample to score with the reward loaded under `key` (`payload` None). It
answers each with one frame on WRITE_FD: ``("ok", value)`` (None for a load), ``("raised", "TypeName:
message")`` (the reward raised), or ``("failed", why)`` (the reward could not be loaded, or its result cannot
be pickled). The frames have pipes of their own, so a reward
may print to stdout and stderr (both are the parent's).

It exits when READ_FD reaches end of file (the parent closed it), and is killed when the parent dies (Linux:
``PR_SET_PDEATHSIG``), so a worker never outlives its run. Ctrl-C is the parent's to handle: it is ignored here.
This module imports only the standard library; a reward's own modules are imported when it is unpickled.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import pickle
import signal
import struct
import sys
from typing import Any

HEADER = struct.Struct(">Q")
PATH_ENV = "RLX_REWARD_WORKER_PATH"  # the parent's sys.path (JSON), so rewards unpickle as they were built


def read_frame(fd: int) -> bytes | None:
    """One frame from `fd`; None at end of file."""
    head = _read_exactly(fd, HEADER.size)
    if head is None:
        return None
    body = _read_exactly(fd, HEADER.unpack(head)[0])
    if body is None:
        raise EOFError("the pipe closed in the middle of a frame")
    return body


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def write_frame(fd: int, body: bytes) -> None:
    data = memoryview(HEADER.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data):]


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


def _score(reward: Any, sample: object) -> Any:  # a reward of any shape: the worker imports no rlx
    value = reward.score(sample)
    if inspect.isawaitable(value):
        async def wait() -> Any:
            return await value

        value = asyncio.run(wait())
    return value


def serve(rfd: int, wfd: int) -> None:
    rewards: dict[str, Any] = {}
    while True:
        frame = read_frame(rfd)
        if frame is None:
            return
        reply: tuple[str, Any]
        key, payload, sample = pickle.loads(frame)
        if payload is not None:  # load only (the parent times it apart from scoring)
            try:
                rewards[key] = pickle.loads(payload)
                reply = ("ok", None)
            except Exception as e:  # noqa: BLE001 - reported with the sample
                reply = ("failed", f"could not be loaded in the worker process ({type(e).__name__}: {e})")
        else:
            try:
                reply = ("ok", _score(rewards[key], sample))
            except Exception as e:  # noqa: BLE001 - reported with the sample; the worker goes on
                reply = ("raised", f"{type(e).__name__}: {e}")
        try:
            body = pickle.dumps(reply)
        except Exception as e:  # noqa: BLE001 - reported with the sample
            why = f"returned what cannot be sent back from the worker process ({type(e).__name__}: {e})"
            body = pickle.dumps(("failed", why))
        write_frame(wfd, body)


def main(argv: list[str]) -> None:
    rfd, wfd, parent = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)
    for p in reversed(json.loads(os.environ.get(PATH_ENV, "[]"))):
        if p not in sys.path:
            sys.path.insert(0, p)
    serve(rfd, wfd)


if __name__ == "__main__":
    main(sys.argv[1:])
