"""Cores used per phase of a step, from the CPU seconds of the run's processes (see `rlx.cpu`)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable


def _kernel_and_pid_namespace() -> str:
    """This machine's running kernel (its boot id) and this process's PID namespace: processes that share both
    see each other's PIDs, and can read each other's CPU clocks (`cpu_clock`). Empty where there is no /proc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


_HERE = _kernel_and_pid_namespace()


def process_identity(pid: int | None = None) -> str:
    """A process of the run, as ``host:pid@kernel/pid-namespace`` (this one by default)."""
    import socket

    return f"{socket.gethostname()}:{pid or os.getpid()}@{_HERE}"


def process_cpu() -> tuple[str, float]:
    """This process (`process_identity`) and the CPU seconds all its threads have used."""
    return process_identity(), time.process_time()


def cpu_clock(identity: str | None) -> Any:
    """A function returning the CPU seconds (all threads) of the process `identity` names, read from the kernel
    without asking the process (a fraction of a microsecond against a millisecond for a call), when it runs
    beside this one (same kernel and PID namespace) and is alive; else None. Once the process is gone, the
    function raises OSError."""
    if not identity or "@" not in identity:
        return None
    name, where = identity.rsplit("@", 1)
    if not _HERE or where != _HERE:
        return None
    clock = ((~int(name.rsplit(":", 1)[1])) << 3) | 2  # the kernel's per-process CPU clock id (clock_getcpuclockid)
    try:
        time.clock_gettime(clock)
    except (OSError, OverflowError):
        return None
    return lambda: time.clock_gettime(clock)


def _identities(engines: list[Any]) -> list[str | None]:
    """Each engine's `process_identity` (None: it cannot tell, such as an attached engine)."""
    out = []
    for e in engines:
        try:
            out.append(e.identity() if hasattr(e, "identity") else None)
        except Exception:  # noqa: BLE001 - a metric: an engine whose host does not answer is asked over HTTP
            out.append(None)
    return out


class CoreMeter:
    """CPU seconds of the run's processes at phase boundaries, turned into cores used per phase.

    `trainer_cpu()` returns each trainer rank's process and CPU seconds (`process_cpu`); `engines()` the engines
    serving now (each with
    ``url`` and ``client()``), counted when they report ``process_cpu_seconds_total``. A process counts in an
    interval when it reported at both ends (an engine restarted in between, whose counter went back, does not).
    """

    def __init__(self, trainer_cpu: Callable[[], list[tuple[str, float]]], engines: Callable[[], Iterable[Any]],
                 clock: Callable[[], float] = time.monotonic, own_cpu: Callable[[], tuple[str, float]] | None = None):
        self.trainer_cpu = trainer_cpu
        self.engines = engines
        self.clock = clock  # wall time
        self.own_cpu = own_cpu or process_cpu  # the driver process: (identity, CPU seconds)
        self.marks: list[tuple[float, dict[str, float]]] = []  # (wall, CPU seconds by process) at each mark
        # After the first mark: each process's CPU clock, when every one runs beside this process (`cpu_clock`);
        # later marks read those instead of asking. A meter lasts a step: trainers or engines that changed
        # since are asked again at the next step's first mark.
        self.learn = True
        self.clocks: dict[str, Any] | None = None

    async def _cpu(self) -> dict[str, float]:
        if self.clocks is not None:  # every process runs beside this one: read their clocks, ask none
            out = {}
            for key, read in self.clocks.items():
                try:
                    out[key] = read()
                except OSError:  # gone since: it reported at one end only, so it does not count
                    pass
            return out
        import asyncio

        async def engine(e):
            try:
                async with e.client(timeout_s=10) as c:
                    return e.url, await c.cpu_seconds()
            except Exception:  # noqa: BLE001 - a metric: an engine that does not answer now is left out
                return e.url, None

        # at once: a mark is on the step's path (the trainer's answer and an engine's take about a millisecond each)
        serving = list(self.engines())
        trainers, where, *engines = await asyncio.gather(
            asyncio.to_thread(self.trainer_cpu), asyncio.to_thread(_identities, serving),
            *(engine(e) for e in serving))
        # keyed by process: a trainer rank in the driver's own process (no Ray) counts once
        own = self.own_cpu()
        out = dict([own, *(trainers or [])])
        out.update({u: s for u, s in engines if s is not None})
        if self.learn:
            clocks = {own[0]: time.process_time} if self.own_cpu is process_cpu else {}
            for key in [k for k, _ in trainers or []]:
                clocks.setdefault(key, cpu_clock(key))
            for e, identity in zip(serving, where, strict=True):
                clocks[e.url] = cpu_clock(identity)
            self.learn = False
            if clocks.keys() == out.keys() and all(clocks.values()):
                self.clocks = clocks
                return await self._cpu()  # both ends of every interval from the same clocks
        return out

    async def mark(self) -> None:
        self.marks.append((self.clock(), await self._cpu()))

    def cores(self, names: Sequence[str]) -> dict[str, float]:
        """``cores/<name>`` for each interval between consecutive marks, then forget them."""
        out = {}
        for name, (w0, c0), (w1, c1) in zip(names, self.marks, self.marks[1:], strict=False):
            used = sum(max(0.0, c1[k] - c0[k]) for k in c0.keys() & c1.keys())
            if w1 > w0:
                out[f"cores/{name}"] = used / (w1 - w0)
        self.marks = []
        return out
