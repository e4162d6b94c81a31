"""Finding the processes a test started, by an environment tag they inherit, to check none is left."""

from __future__ import annotations

import time
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


def environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with (Linux /proc)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def wait_gone(tag: str, timeout: float = 20, var: str = "RLX_TEST_TAG") -> list[int]:
    """Wait until no process carries the tag; returns those still there after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := processes_tagged(tag, var)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
