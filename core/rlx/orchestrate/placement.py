"""Where a run's pieces go: the Ray cluster and placement group, engines on their bundles, the trainer
ranks with their CPU threads (`rlx.cpu`), and ``placement.json``.

Placement (``ray.placement``):

* ``colocated``: engines share the trainers' bundles (and so their GPUs), as when actor and rollout
  time-share devices.
* ``disaggregated``: engines get bundles of their own.

Without Ray (``ray.enabled: false``) there is no placement: one trainer rank runs in this process.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.config import Config, launched_groups
from rlx.errors import RLXError
from rlx.net import node_ip
from rlx.orchestrate.ranks import LocalTrainerGroup, TrainerGroup, ray_trainer_group
from rlx.orchestrate.ray_head import end_token_auth, start_head, stderr_to

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from ray.util.placement_group import PlacementGroup


def launched_engines(cfg: Config) -> int:
    return sum(g.num_engines for g in launched_groups(cfg))


class RayPlacement:
    """A Ray cluster (started here, or joined at ``ray.address``) and one placement group for the run."""

    def __init__(self, cfg: Config, verbose: bool = False):
        """`verbose`: let Ray print to this terminal while it connects (else it goes to logs/driver.log)."""
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError:
            raise RLXError("ray.enabled is true but Ray is not installed: pip install 'rlx[train]' "
                           "(or set ray.enabled: false to train in this process)") from None

        rc = cfg.ray
        self.head = None
        init: dict[str, Any] = dict(log_to_driver=rc.log_to_driver,
                    runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("RLX_")}})
        logs = Path(cfg.run.output_dir) / "logs"
        bundles = self._bundles(cfg)
        if rc.address is None and not ray.is_initialized():  # the CPUs of the cluster it would start: before it
            self._check_fits(bundles, {"CPU": rc.num_cpus or os.cpu_count() or 1}, ("CPU",))
        with stderr_to(None if verbose else logs / "driver.log"):
            if rc.address is None and not ray.is_initialized():
                self.head = start_head(rc.num_cpus, logs, init)
            elif not ray.is_initialized():
                ray.init(address=rc.address, **init)
        try:
            self._place(cfg, ray, placement_group, bundles)
        except BaseException:
            if self.head is not None:  # the run's own cluster goes with the failed start
                ray.shutdown()
                self.head.stop(grace_s=30)
                end_token_auth()
            raise

    def _bundles(self, cfg: Config) -> list[dict[str, float]]:
        """The run's bundles: trainer ranks (each with its critic rank where they share), then engines."""
        rc = cfg.ray
        actors = cfg.train.parallel.world_size
        critics = cfg.train.critic.parallel.world_size if cfg.train.critic.parallel is not None else 0
        shared = cfg.train.critic.placement == "shared"
        # shared: bundle r holds actor rank r and critic rank r, where they exist; own: the critic's bundles follow
        self.trainer_bundles = max(actors, critics) if shared else actors + critics
        self.colocated = rc.placement == "colocated"
        bundles = []
        for r in range(self.trainer_bundles):
            ranks = (r < actors) + (r < critics) if shared else 1
            bundle = {"CPU": rc.cpus_per_trainer * ranks}
            if rc.gpus_per_trainer:
                bundle["GPU"] = rc.gpus_per_trainer
            bundles.append(bundle)
        if self.colocated:
            # Engines share the actor's bundles; each bundle gets room for one engine's CPU as well.
            for i in range(launched_engines(cfg)):
                bundles[i % actors]["CPU"] += rc.cpus_per_engine
        else:
            eb = {"CPU": rc.cpus_per_engine}
            if rc.gpus_per_engine:
                eb["GPU"] = rc.gpus_per_engine
            bundles += [dict(eb) for _ in range(launched_engines(cfg))]
        return bundles

    @staticmethod
    def _check_fits(bundles: list[dict[str, float]], total: dict[str, float], kinds: tuple[str, ...]) -> None:
        """A cluster started here cannot grow: say so now rather than after the placement timeout."""
        for res in kinds:
            need = sum(b.get(res, 0) for b in bundles)
            if need > total.get(res, 0):
                raise RLXError(
                    f"the run needs {need:g} {res} for its bundles {bundles} but this Ray cluster has "
                    f"{total.get(res, 0):g}; lower ray.cpus_per_trainer / ray.cpus_per_engine (fractions are "
                    f"fine), set ray.num_cpus, or use ray.placement: colocated")

    def _place(self, cfg: Config, ray: ModuleType, placement_group: Callable[..., PlacementGroup],
               bundles: list[dict[str, float]]) -> None:
        rc = cfg.ray
        actors = cfg.train.parallel.world_size
        engines = launched_engines(cfg)
        if self.head is not None:
            self._check_fits(bundles, ray.cluster_resources(), ("CPU", "GPU"))
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=rc.placement_timeout_s)
        except Exception:
            raise RLXError(f"Ray could not place the run's {len(bundles)} bundles {bundles} within "
                           f"{rc.placement_timeout_s:.0f}s; available: {ray.available_resources()}") from None
        self.engine_bundles = (
            [i % actors for i in range(engines)] if self.colocated
            else list(range(self.trainer_bundles, self.trainer_bundles + engines))
        )

    def thread_plan(self, cfg: Config) -> Any:
        """Threads for each trainer process (actor ranks, then the critic's) and engine, from the nodes Ray put
        their bundles on and each node's CPUs (`rlx.cpu`)."""
        import ray
        from ray.util.placement_group import placement_group_table

        from rlx.cpu.threads import plan_threads

        node_of = placement_group_table(self.pg)["bundles_to_node_id"]
        cores = {n["NodeID"]: int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n.get("Alive")}
        actors = cfg.train.parallel.world_size
        critics = cfg.train.critic.parallel.world_size if cfg.train.critic.parallel is not None else 0
        first_critic = 0 if cfg.train.critic.placement == "shared" else actors
        trainers = [*range(actors), *range(first_critic, first_critic + critics)]
        rc = cfg.ray
        return plan_threads(cfg.train.mode, cores, [node_of[b] for b in trainers],
                            [node_of[b] for b in self.engine_bundles], rc.cpus_per_trainer, rc.cpus_per_engine,
                            cfg.cpu.threads, cfg.cpu.async_cores)

    def engine_spawner(self, cfg: Config):
        """A function making engine processes inside Ray actors placed on the engine bundles."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rc = cfg.ray
        gpus = 0.0 if self.colocated else rc.gpus_per_engine
        actor: Any = ray.remote(num_cpus=rc.cpus_per_engine, num_gpus=gpus)(EngineHost)  # Ray's types lack .remote
        bundles = iter(zip(self.engine_bundles, self.thread_plan(cfg).engine, strict=True))
        placed: dict[Path, tuple[int, int]] = {}  # an engine restarted (same log) goes back to its own bundle

        def spawn(command, log_path: Path, env: dict[str, str] | None = None):
            if log_path not in placed:
                placed[log_path] = next(bundles)
            bundle, threads = placed[log_path]
            host = actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=bundle)).remote()
            ip, port = ray.get(host.address.remote(), timeout=rc.placement_timeout_s)  # a restart waits for its bundle
            ray.get(host.start.remote(command(ip, port, threads), str(log_path), env))
            return RayProcess(host, log_path), f"http://{ip}:{port}"

        return spawn

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
            ray.shutdown()
            if self.head is not None:
                # the run's own cluster, with its trainers and engines gone and this driver disconnected: nothing
                # in it needs an orderly stop (its object store is in memory, not in /dev/shm files)
                self.head.kill()
        finally:
            if self.head is not None:
                end_token_auth()


class EngineHost:
    """A Ray actor owning one engine server process (so it runs where Ray placed it, on that node's
    address)."""

    def __init__(self) -> None:
        self.process: Any = None

    def address(self) -> tuple[str, int]:
        from rlx.net import free_port

        ip = node_ip()
        return ip, free_port(ip)

    def start(self, cmd: list[str], log_path: str, env: dict[str, str] | None = None) -> None:
        from rlx.rollout.engines.launch import ManagedProcess

        self.process = ManagedProcess(cmd, Path(log_path))
        self.process.start(env)

    def alive(self) -> bool:
        return self.process.alive()

    def returncode(self) -> int | None:
        return self.process.proc.returncode if self.process.proc else None

    def pid(self) -> int | None:
        return self.process.pid

    def identity(self) -> str | None:
        return self.process.identity()

    def log_tail(self, n: int = 20) -> str:
        return self.process.log_tail(n)

    def stop(self, grace_s: float = 10.0) -> None:
        self.process.stop(grace_s)


class RayProcess:
    """The ManagedProcess interface, for an engine process that an `EngineHost` actor owns."""

    def __init__(self, host: Any, log_path: Path):  # host: a Ray actor handle of an EngineHost
        self.host = host
        self.log_path = log_path
        self._identity: str | None = None

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=30)

    def alive(self) -> bool:
        try:
            return self._get(self.host.alive.remote())
        except Exception:
            return False

    @property
    def returncode(self) -> int | None:
        try:
            return self._get(self.host.returncode.remote())
        except Exception:
            return None

    @property
    def pid(self) -> int | None:
        return self._get(self.host.pid.remote())

    def identity(self) -> str | None:
        """The engine process's `rlx.cpu.meter.process_identity`, asked of its host once."""
        if self._identity is None:
            self._identity = self._get(self.host.identity.remote())
        return self._identity

    def log_tail(self, n: int = 20) -> str:
        try:
            return self._get(self.host.log_tail.remote(n))
        except Exception:
            return "(engine host unreachable)"

    def stop(self, grace_s: float = 10.0) -> None:
        import ray

        try:
            self._get(self.host.stop.remote(grace_s))
        finally:
            ray.kill(self.host)


def shares_gpu(cfg: Config) -> bool:
    """Whether trainer ranks and engines may use the same GPU (colocated on Ray's bundles, or one process without
    Ray on a machine with one)."""
    if cfg.ray.enabled:
        return cfg.ray.placement == "colocated" and cfg.ray.gpus_per_trainer > 0
    import torch

    return torch.cuda.is_available()


def write_placement(out: Path, trainer_hosts: list[str], engine_urls: list[str]) -> None:
    """Where the run's pieces ended up (``placement.json``): each trainer rank's address and each engine's URL."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / "placement.json").write_text(json.dumps({"trainers": trainer_hosts, "engines": engine_urls}, indent=1))


def start_trainers(cfg: Config, verbose: bool = False) -> tuple[Any, TrainerGroup]:
    """(placement or None, trainer group): Ray actors when ``ray.enabled``, else one local rank."""
    placement = place(cfg, verbose)
    try:
        return placement, make_trainers(cfg, placement)
    except BaseException:
        if placement is not None:
            placement.shutdown()
        raise


def place(cfg: Config, verbose: bool = False) -> Any:
    """The run's Ray placement (its cluster and placement group), or None with ``ray.enabled: false``."""
    return RayPlacement(cfg, verbose) if cfg.ray.enabled else None


def make_trainers(cfg: Config, placement: RayPlacement | None) -> TrainerGroup:
    """The trainer group with its threads set: Ray actors in `placement`, or one local rank when it is None."""
    trainer = LocalTrainerGroup(cfg) if placement is None else ray_trainer_group(cfg, placement.pg)
    try:
        set_trainer_threads(cfg, placement, trainer)
    except BaseException:
        trainer.shutdown()
        raise
    return trainer


def set_trainer_threads(cfg: Config, placement: RayPlacement | None, trainer: TrainerGroup) -> None:
    """Each trainer rank's torch threads (`rlx.cpu`); logged once."""
    from rlx.cpu.threads import engine_threads, local_plan, process_env, waits_sleep_here

    engines = launched_engines(cfg)
    local = local_plan(cfg.train.mode, engines, cfg.ray.cpus_per_trainer, cfg.ray.cpus_per_engine, cfg.cpu.threads,
                       cfg.cpu.async_cores)
    plan = local if placement is None else placement.thread_plan(cfg)
    # Without Ray the trainer is this process, started before the config was read: if its waiting threads spin,
    # they would hold cores the engines share (spinning waits made sharing slower than splitting), so it keeps
    # what it reserved (rlx.cpu).
    spinning_here = (placement is None and cfg.train.mode == "async" and cfg.cpu.async_cores == "share"
                     and not cfg.cpu.threads and not waits_sleep_here())
    if spinning_here:
        plan = dataclasses.replace(plan, trainer=local_plan(cfg.train.mode, engines, cfg.ray.cpus_per_trainer,
                                                            async_cores="split").trainer)
    trainer.set_threads(plan.trainer)
    planned = iter(plan.engine or local.engine)
    threads = []  # each embedded engine's: the plan, or its group's server_args.num_threads
    for g in launched_groups(cfg):
        for _ in range(g.num_engines):
            t = next(planned)
            if g.backend == "embedded":
                threads.append(engine_threads(t, g.model_path or cfg.model.path, g.server_args))
    engines_text = f", engines {threads}" if threads else ""
    mode: str = cfg.train.mode
    if mode == "async":  # how the two phases share a node's cores, and whether waiting threads sleep in each
        mode += f" mode, cores {'shared' if cfg.cpu.async_cores == 'share' else 'split'}"
        engine_policy = process_env(cfg.train.mode, cfg.cpu.async_cores).get(
            "OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "unset"))
        policies = sorted(set(trainer.wait_policies()))
        engines_text += (f"; OMP_WAIT_POLICY: trainer ranks {'/'.join(policies)}"
                         + (f", engines {engine_policy}" if engines else ""))
        if spinning_here:
            engines_text += ("; the trainer runs in this process, whose waiting threads spin: it keeps "
                             "ray.cpus_per_trainer threads (start rl with OMP_WAIT_POLICY=PASSIVE to share)")
    else:
        mode += " mode"
    print(f"rlx: CPU threads ({mode}): trainer ranks {plan.trainer}{engines_text}", file=sys.stderr, flush=True)
