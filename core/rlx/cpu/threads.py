"""CPU threads per process: plans for trainer ranks and engines, OpenMP wait policies (see `rlx.cpu`)."""

from __future__ import annotations

import os
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


def set_threads(n: int) -> None:
    """Run torch's intra-op work (and OpenMP's) on `n` threads in this process."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)  # for libraries that read it later
    torch.set_num_threads(n)
