"""Starting engine servers (SGLang or embedded) as processes, and waiting until they serve.

Choices:

* Both backends are separate processes on 127.0.0.1 with their own port, each in its own process
  group so that stopping one stops everything it spawned (SGLang forks schedulers). Logs go to a file
  per engine; a failed start shows that log's tail.
* The SGLang command line is built from config: model path, TP, memory fraction, disaggregation mode
  from the worker type, and every ``server_args`` key passed through as ``--key value`` (``true``
  becomes a bare flag, ``false`` drops it, a list repeats values), so new SGLang flags need no rlx
  change.
* Waiting polls ``/health`` and watches the process: a process that exits is reported at once with
  its exit code and log, a slow one after ``timeout_s``; never a hang.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlx.net import LOOPBACK, free_port
from rlx.rollout.engines.client import EngineClient, EngineError

__all__ = ["HOST", "ManagedProcess", "embedded_command", "flags", "free_port", "sglang_command", "sglang_cpu_args",
           "wait_healthy"]

HOST = LOOPBACK


def flags(args: dict[str, Any]) -> list[str]:
    """``{"chunked_prefill_size": 4096, "enable_x": True}`` -> ``--chunked-prefill-size 4096 --enable-x``."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def sglang_command(model_path: str, port: int, *, tp_size: int = 1, mem_fraction_static: float | None = None,
                   worker_type: str = "regular", server_args: dict[str, Any] | None = None,
                   host: str = HOST, python: str | None = None) -> list[str]:
    """`python`: the interpreter of SGLang's environment (default: this one)."""
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--tp-size", str(tp_size)]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if worker_type in ("prefill", "decode"):
        cmd += ["--disaggregation-mode", worker_type]
    return cmd + flags(server_args or {})


#: Set in an fp32 SGLang server's environment on a CPU. SGLang takes its AMX kernels wherever the CPU has AMX (Intel
#: Xeon from Sapphire Rapids on), and their CPU build holds bf16 and fp16 only: an fp32 model dies at its first forward
#: ("rmsnorm_kernel" not implemented for 'Float'). rlx serves fp32 on CPUs (the trainer's precision), so the SGLang CPU
#: environment that scripts/sglang-cpu-env makes reads this and takes SGLang's torch path, as on CPUs without AMX.
NO_AMX_ENV = "RLX_SGLANG_NO_AMX"


def sglang_cpu_args(model_path: str, *, requests: int, new_tokens: int, engines: int) -> dict[str, Any]:
    """What SGLang needs to serve on a CPU beside ``--device cpu`` (and ``SGLANG_USE_CPU_ENGINE=1`` in its
    environment): its scheduler without the overlap thread and asleep when idle, and a KV pool bounded by what
    the run asks of it, as SGLang would otherwise size it from the machine's whole memory (13 GB for a tiny model,
    measured). The pool
    holds the model's full context and `requests` requests of `new_tokens` after a 512-token prompt, at most a
    quarter of the memory free now, shared by `engines` engines; fp32 KV (SGLang's CPU default here)."""
    from rlx.models.tiny import model_config

    model = model_config(model_path)
    heads = model.get("num_key_value_heads") or model["num_attention_heads"]
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    per_token = 2 * model["num_hidden_layers"] * heads * head_dim * 4
    context = int(model.get("max_position_embeddings") or 4096)
    want = max(context, requests * (512 + new_tokens))
    budget = _mem_available() // 4 // max(engines, 1) // per_token
    # sleep_on_idle: an idle scheduler otherwise spins a core (92% measured), the one the trainer needs between
    # rollouts; it wakes on its sockets
    return {"device": "cpu", "disable_overlap_schedule": True, "sleep_on_idle": True,
            "max_total_tokens": max(1024, min(want, budget))}


def _mem_available() -> int:
    """Bytes of memory free for new work now (/proc/meminfo's MemAvailable; 8 GiB where that is unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def embedded_command(model_path: str, port: int, *, server_args: dict[str, Any] | None = None,
                     host: str = HOST) -> list[str]:
    return [sys.executable, "-m", "rlx.rollout.engines.embedded", "--model-path", model_path,
            "--host", host, "--port", str(port), *flags(server_args or {})]


class Process(Protocol):
    """An engine process rlx started: here (`ManagedProcess`) or inside a Ray actor
    (`rlx.orchestrate.placement.RayProcess`)."""

    log_path: Path

    @property
    def returncode(self) -> int | None: ...

    def alive(self) -> bool: ...

    def log_tail(self, n: int = 20) -> str: ...


@dataclass
class ManagedProcess:
    """A server process rlx started, with where its log goes."""

    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def identity(self) -> str | None:
        """The process as `rlx.cpu.meter.process_identity` names it (it runs beside this one)."""
        from rlx.cpu.meter import process_identity

        return process_identity(self.pid) if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after `grace_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the process group at once and reap the process: for a server whose work is over and whose
        own orderly stop only takes time (a run's Ray head stops its daemons one after another, ~3 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.proc.wait(5)


def _load_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:  # not glibc Linux: no parent-death signal
        return None


# resolved here, not in a forked child: dlopen/dlsym after fork in a threaded process can deadlock on glibc's lock
_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies, even by SIGKILL (Linux)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def wait_healthy(url: str, process: Process | None, timeout_s: float, what: str = "engine") -> None:
    """Poll ``/health`` until it answers 200; fail at once if the process dies."""
    deadline = time.monotonic() + timeout_s
    async with EngineClient(url, timeout_s=10) as client:
        while True:
            if process is not None and not process.alive():
                code = process.returncode
                raise EngineError(f"{what} at {url} exited with code {code} before it was healthy; "
                                  f"log {process.log_path}:\n{process.log_tail()}")
            if await client.health(timeout_s=5):
                return
            if time.monotonic() > deadline:
                tail = f"; log {process.log_path}:\n{process.log_tail()}" if process else ""
                raise EngineError(f"{what} at {url} not healthy after {timeout_s:.0f}s{tail}")
            await asyncio.sleep(0.25)
