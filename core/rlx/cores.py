"""How many CPU threads each trainer rank and engine uses, and how many cores each phase of a step used.

Ray gives an actor as many threads as CPUs it reserved (it sets ``OMP_NUM_THREADS``; one by default), so a
trainer rank on an 8-core machine would train on one core while the engine beside it idles. rlx sets the
threads itself:

- **sync mode**: rollout, training and weight sync take turns, so each phase runs alone on the machine. Each
  trainer rank gets its node's cores divided by the trainer ranks there (actor and critic), each engine its
  node's cores divided by the engines there.
- **async mode**: rollout and training run at once. ``train.async_cores`` says how they use the cores:
  - ``share`` (the default): each process gets the threads it would have in sync mode, and starts with
    ``OMP_WAIT_POLICY=PASSIVE`` (unless the environment sets a policy), so that an OpenMP thread that waits
    sleeps instead of spinning on a core the other phase could use. Whichever phase is busy gets the cores the
    other leaves idle. On 2 cores, SmolLM2-135M: 8.1-10.0 s/step against 10.9-11.5 s split 1 + 1
    (benchmarks/RESULTS.md, 2026-11-24). Without Ray the trainer runs in the driver's process, which started
    before the config was read: unless it was started with ``OMP_WAIT_POLICY=PASSIVE``, its threads spin, and
    it keeps ``ray.cpus_per_trainer`` threads instead (the engines still share).
  - ``split``: each process keeps what it reserved, ``ray.cpus_per_trainer`` and ``ray.cpus_per_engine``
    (at least one thread), which divide the machine. Better where ops are too small to use several threads
    (the tiny test model: 0.109 s/step against 0.123 shared), or where steady per-phase timings matter.
- An embedded engine of a model under a million parameters (a test model) decodes on one thread in either mode
  (`engine_threads`): its ops are too small to split, and a second thread spinning between them takes the core
  that the engine's HTTP thread and the driver need while it generates.
- ``train.threads`` (trainer ranks) and an engine group's ``server_args.num_threads`` override both.

One OpenMP team per process: a torch op large enough to run in parallel starts a team of threads on the thread
that calls it, and keeps it for that thread's life. With more OpenMP threads in a process than cores, libgomp
makes waiting threads sleep almost at once (its throttled spin), and every parallel op then waits for its threads
to wake: an elementwise op on 2 cores went from 75 to 115 us, the tiny model's train step from 37 to 50 ms. So
nothing but the thread that runs the model may run large torch ops: the matmul kernel's measurement runs on a
thread of its own that ends (`rlx.builtins.kernels`), and a trainer skips megatron's collectives over one rank,
which gloo would run on its own thread (`rlx.train.model.skip_lone_collectives`; a test counts the threads).

A node's cores are what Ray counts for it (``ray.num_cpus`` for a cluster started here), or this process's
CPU affinity without Ray.

Cores used per phase: the CPU seconds that the driver, the trainer ranks and the engines spent during the
phase, divided by its wall time (``cores/rollout``, ``cores/train``, ``cores/weight_sync``). Reward worker
processes are not counted. A step's first mark asks each process; when all run on the driver's machine, the
step's later marks read their CPU clocks from the kernel instead (each ask is a millisecond on the step's path).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def local_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


@dataclass
class ThreadPlan:
    trainer: list[int]  # per trainer process, in the order their nodes were given
    engine: list[int]  # per engine, likewise


def plan_threads(mode: str, node_cores: dict[str, int], trainer_nodes: Sequence[str], engine_nodes: Sequence[str],
                 cpus_per_trainer: float = 1, cpus_per_engine: float = 1, trainer_threads: int | None = None,
                 async_cores: str = "share") -> ThreadPlan:
    """Threads for each trainer process and engine, given the node each runs on (see the module docstring)."""
    trainers_on, engines_on = Counter(trainer_nodes), Counter(engine_nodes)
    if mode == "async" and async_cores == "split":
        trainer = [max(1, int(cpus_per_trainer))] * len(trainer_nodes)
        engine = [max(1, int(cpus_per_engine))] * len(engine_nodes)
    else:
        trainer = [max(1, node_cores[n] // trainers_on[n]) for n in trainer_nodes]
        engine = [max(1, node_cores[n] // engines_on[n]) for n in engine_nodes]
    if trainer_threads:
        trainer = [trainer_threads] * len(trainer_nodes)
    return ThreadPlan(trainer, engine)


def local_plan(mode: str, engines: int, cpus_per_trainer: float = 1, cpus_per_engine: float = 1,
               trainer_threads: int | None = None, async_cores: str = "share") -> ThreadPlan:
    """The plan without Ray: one trainer rank (this process) and `engines` engines, all on this machine."""
    return plan_threads(mode, {"here": local_cores()}, ["here"], ["here"] * engines, cpus_per_trainer=cpus_per_trainer,
                        cpus_per_engine=cpus_per_engine, trainer_threads=trainer_threads, async_cores=async_cores)


# Models smaller than this decode on one thread (`engine_threads`).
SMALL_MODEL_PARAMETERS = 1_000_000


def approx_parameters(model_path: str) -> int | None:
    """About how many parameters the HF checkpoint at `model_path` has, from its config (12 h^2 a layer, the
    embedding and output layer); None when its config cannot be read."""
    from rlx.models.tiny import model_config

    try:
        c = model_config(model_path)
        h, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return 12 * layers * h * h + (1 if c.get("tie_word_embeddings") else 2) * vocab * h


def engine_threads(planned: int, model_path: str, server_args: dict[str, Any]) -> int:
    """An embedded engine's CPU threads: its group's ``server_args.num_threads``, else the plan's, but one for a
    model of fewer than `SMALL_MODEL_PARAMETERS`: its ops are too small to split, and a second thread, spinning
    between them, takes the core the engine's HTTP thread and the driver need during the rollout (the tiny model,
    sync mode: a decode step alone took 0.74 ms on 2 threads against 0.87 on 1, but the rollout 0.042-0.046 s
    against 0.036; benchmarks/RESULTS.md, 2026-11-24)."""
    if server_args.get("num_threads"):
        return int(server_args["num_threads"])
    size = approx_parameters(model_path)
    return 1 if size is not None and size < SMALL_MODEL_PARAMETERS else planned


def process_env(mode: str, async_cores: str) -> dict[str, str]:
    """What trainer rank and engine processes start with, on top of this process's environment: in async mode with
    shared cores, OpenMP threads that wait sleep at once (it is read when the library loads: a process's
    start is the only time to set it). A wait policy set in this environment is passed on instead (explicitly:
    the workers of a cluster joined by address do not inherit this environment)."""
    if mode == "async" and async_cores == "share":
        return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    return {}


def waits_sleep_here() -> bool:
    """Whether this process's OpenMP threads sleep when they wait: ``OMP_WAIT_POLICY=PASSIVE`` in its environment
    (OpenMP reads it once, when torch loads it; set later, it is seen here but does nothing)."""
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


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


def set_threads(n: int) -> None:
    """Run torch's intra-op work (and OpenMP's) on `n` threads in this process."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)  # for libraries that read it later
    torch.set_num_threads(n)


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

    def __init__(self, trainer_cpu: Any, engines: Any, clock: Any = time.monotonic, own_cpu: Any = None):
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
