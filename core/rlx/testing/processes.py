"""Finding the processes a test started, by an environment tag they inherit, to check none is left; `rl serve`
started and stopped as a user would."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path


def processes_tagged(tag: str, var: str = "RLX_TEST_TAG") -> list[int]:
    """PIDs of live processes whose environment has ``var=tag`` (Linux /proc)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if f"{var}={tag}".encode() in (p / "environ").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def tagged_pids(tag: str, needle: bytes) -> list[int]:
    """`processes_tagged(tag)` whose command line holds `needle` (an engine's module, a Ray actor's class), sorted."""
    out = []
    for pid in processes_tagged(tag):
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:  # gone meanwhile
            pass
    return sorted(out)


def environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with (Linux /proc)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def wait_gone(tag: str, timeout: float = 20, var: str = "RLX_TEST_TAG",
              keep: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """Wait until no process carries the tag but those in `keep`; returns the others still there after `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in processes_tagged(tag, var) if p not in keep]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@contextlib.contextmanager
def rl_serve(config: Path, *args: str, start_timeout: float = 300, stop: int = signal.SIGINT) -> Iterator[str]:
    """``rl serve CONFIG --port <free> --api-key k1 ARGS``: yields its OpenAI base URL (``.../v1``) once it serves,
    then stops it with `stop` (Ctrl-C's SIGINT, or SIGTERM), which must end it cleanly (exit 0, "stopped"), and
    everything it started, within a minute."""
    from rlx.net import free_port

    tag = uuid.uuid4().hex
    p = subprocess.Popen([sys.executable, "-m", "rlx_cli.main", "serve", str(config), "--port", str(free_port()),
                          "--api-key", "k1", *args], env={**os.environ, "RLX_TEST_TAG": tag},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line, deadline = "", time.monotonic() + start_timeout
        stdout, stderr = p.stdout, p.stderr
        assert stdout is not None and stderr is not None
        while "base_url" not in line:
            assert time.monotonic() < deadline and p.poll() is None, stderr.read()[-3000:]
            line = stdout.readline()
        found = re.search(r"base_url (\S+)", line)
        assert found is not None
        yield found.group(1)
    finally:
        p.send_signal(stop)
        try:
            p.wait(60)
        finally:
            if p.poll() is None:  # it did not stop: the test fails below, and leaves nothing behind
                p.kill()
                p.wait()
                for pid in processes_tagged(tag):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    out, err = p.communicate()
    assert p.returncode == 0 and "stopped" in out, err[-3000:]
    assert wait_gone(tag) == [], f"left behind: {processes_tagged(tag)}"
