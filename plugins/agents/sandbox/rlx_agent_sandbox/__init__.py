"""Throwaway sandboxes for agent tools and test-based rewards: a temporary directory, a time limit, a
memory limit and no network (a Linux network namespace)."""

from __future__ import annotations

import asyncio
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl
from rlx.types import RewardResult, Sample

__all__ = ["Result", "Sandbox", "SandboxError", "SandboxTests"]


class SandboxError(Exception):
    """The sandbox itself could not do what was asked (not: the program inside failed)."""


@dataclass
class Result:
    returncode: int | None  # None when killed for the time limit
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@lru_cache(maxsize=1)
def netns_prefix() -> tuple[str, ...] | None:
    """The command prefix that gives a process an empty network namespace here, or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ((unshare, "-n"), (unshare, "-rn")):
        try:
            r = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return prefix
    return None


class Sandbox:
    def __init__(self, time_limit_s: float = 10.0, memory_mb: int = 1024, network: bool = False,
                 max_output_bytes: int = 1 << 20, max_file_mb: int = 64, max_processes: int = 64):
        self.time_limit_s = time_limit_s
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.max_file_mb = max_file_mb
        self.max_processes = max_processes
        self.prefix: tuple[str, ...] = ()
        if not network:
            prefix = netns_prefix()
            if prefix is None:
                raise SandboxError("no network namespace available (needs `unshare -n` as root or unprivileged "
                                   "user namespaces for `unshare -rn`); pass network=True to run without isolation")
            self.prefix = prefix
        self.root: Path | None = None

    # -- lifetime --------------------------------------------------------------------------------

    def __enter__(self) -> Sandbox:
        self.root = Path(tempfile.mkdtemp(prefix="rlx-sandbox-"))
        return self

    def __exit__(self, *exc) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    async def __aenter__(self) -> Sandbox:
        return self.__enter__()

    async def __aexit__(self, *exc) -> None:
        self.__exit__()

    # -- files -----------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        if self.root is None:
            raise SandboxError("the sandbox is not open (use it as a context manager)")
        p = (self.root / name).resolve()
        if not p.is_relative_to(self.root.resolve()):
            raise SandboxError(f"{name!r} is outside the sandbox")
        return p

    def write(self, name: str, content: str | bytes) -> Path:
        p = self.path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
        return p

    def read(self, name: str) -> str:
        p = self.path(name)
        if not p.exists():
            raise SandboxError(f"{name!r} does not exist in the sandbox")
        return p.read_text(errors="replace")

    # -- running ---------------------------------------------------------------------------------

    def _limits(self) -> None:  # in the child, before exec
        mem = self.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fsize = self.max_file_mb * 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.geteuid() != 0:  # root is not bound by RLIMIT_NPROC; do not pretend
            resource.setrlimit(resource.RLIMIT_NPROC, (self.max_processes, self.max_processes))

    async def run(self, cmd: list[str], stdin: str | None = None, timeout_s: float | None = None,
                  env: dict[str, str] | None = None) -> Result:
        """Run `cmd` in the sandbox directory; a failing program is a Result, not an exception."""
        if self.root is None:
            raise SandboxError("the sandbox is not open (use it as a context manager)")
        if not cmd:
            raise SandboxError("empty command")
        exe = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0])
        if exe is None:
            raise SandboxError(f"program {cmd[0]!r} not found")
        limit = timeout_s or self.time_limit_s
        clean_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root), "LANG": "C.UTF-8",
                     "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *self.prefix, exe, *cmd[1:], cwd=self.root, env=clean_env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=self._limits)
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), limit)
            timed_out = False
        except asyncio.TimeoutError:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = await proc.communicate()
            timed_out = True
        cap = self.max_output_bytes
        return Result(None if timed_out else proc.returncode, out[:cap].decode(errors="replace"),
                      err[:cap].decode(errors="replace"), timed_out, time.monotonic() - t0)


# -- the test-based reward -------------------------------------------------------------------------

_FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


class SandboxTests:
    """1.0 when the sample's code passes the dataset label's tests in a sandbox, else 0.0."""

    name = "sandbox_tests"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        time_limit_s: float = Field(10.0, gt=0)
        memory_mb: int = Field(1024, ge=16)
        network: bool = False  # True only where no network namespace can be made (no isolation then)

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    async def score(self, sample: Sample) -> RewardResult:
        blocks = _FENCE.findall(sample.response_text)
        code = blocks[-1] if blocks else sample.response_text
        if not isinstance(sample.label, str) or not sample.label.strip():
            return RewardResult(0.0, info={"result": "no tests: the dataset label must be Python test code"})
        c = self.config
        async with Sandbox(time_limit_s=c.time_limit_s, memory_mb=c.memory_mb, network=c.network) as box:
            box.write("solution.py", code)
            box.write("test_solution.py", sample.label)
            r = await box.run([sys.executable, "test_solution.py"])
            stderr = r.stderr.replace(str(box.root), ".")[-500:]
        why = "timed out" if r.timed_out else f"exit {r.returncode}"
        return RewardResult(1.0 if r.ok else 0.0, info={"result": why, "stderr": stderr})


@hookimpl
def register_rewards(register):
    register(SandboxTests)
