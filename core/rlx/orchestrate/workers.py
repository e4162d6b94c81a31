"""The trainer side of a run as rank workers, and where engines and workers are placed.

`TrainerWorker` is one Megatron rank with everything that must happen next to the weights: a training
step, pushing weights into the engines through the transport (one sender per pipeline stage; the
tensor-parallel ranks take part in gathering each tensor), checkpoints and HF export. It is a plain
class: `TrainerGroup` is the typed interface the loop calls, in process when Ray is off
(`LocalTrainerGroup`) or over Ray actors placed with a placement group (`RayTrainerGroup`). Addresses
come from Ray: rank 0's node hosts the trainers' rendezvous, each sender offers its own node's address.

Placement (``ray.placement``):

* ``colocated``: engines share the trainers' bundles (and so their GPUs), as when actor and rollout
  time-share devices.
* ``disaggregated``: engines get bundles of their own.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from rlx.config import Config
from rlx.cores import process_env
from rlx.errors import RLXError
from rlx.net import node_ip, use_interface_of


def join_ranks(rank: int, world: int, master_addr: str, master_port: int, host: str) -> None:
    """What torch.distributed reads to join this process to its world as `rank`, over `host`'s interface."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"), WORLD_SIZE=str(world),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    use_interface_of(host)


def weight_target(url: str, timeout_s: float) -> Any:
    """The sender's handle on an engine it pushes weights to: one kept-open client per timeout."""
    from rlx.rollout.engines.fleet import Engine

    return Engine(url, "target", timeout_s=timeout_s, keep_clients=True)


class TrainerWorker:
    """One trainer rank: the trainer and the sending side of weight sync. Built empty so that Ray can
    place it first; `start` then joins the ranks at the address rank 0 reported (`address`)."""

    def __init__(self, cfg: Config, host: str | None = None):
        self.cfg = cfg  # already validated, paths absolute: workers never re-read or re-resolve it
        self.host = host or node_ip()
        self.trainer: Any = None
        self.sender: Any = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 holds the trainers' rendezvous: this node's address and a port free on it."""
        from rlx.net import free_port

        return self.host, free_port(self.host)

    def start(self, rank: int, world: int, master_addr: str, master_port: int) -> None:
        join_ranks(rank, world, master_addr, master_port, self.host)
        from rlx.plugins import build_plugins
        from rlx.train.trainer import Trainer
        from rlx.transport.sender import WeightSender

        plugins = build_plugins()
        self.trainer = Trainer(self.cfg, plugins, master_addr)
        tc = self.cfg.train
        self.sender = WeightSender(self.trainer, plugins, tc.transport, tc.verify_weights, tc.verify_full_interval,
                                   engine_for=functools.partial(weight_target,
                                                                timeout_s=self.cfg.rollout.weight_update_timeout_s))

    def node(self) -> str:
        return self.host

    def set_threads(self, n: int) -> None:
        from rlx.cores import set_threads

        set_threads(n)

    def wait_policy(self) -> str:
        """The OpenMP wait policy this process started with (`rlx.cores.process_env`)."""
        return os.environ.get("OMP_WAIT_POLICY", "unset")

    def cpu_seconds(self) -> tuple[str, float]:
        """(this process's identity, its CPU seconds): ranks in the driver's own process count once."""
        from rlx.cores import process_cpu

        return process_cpu()

    def train_step(self, batch: Any) -> dict[str, float]:
        return self.trainer.train_step(batch)

    def ppo_prepare(self, batch: Any, values: Any) -> Any:
        return self.trainer.ppo_prepare(batch, values)

    def ppo_train_actor(self) -> dict[str, float]:
        return self.trainer.ppo_train_actor()

    def setup_transport(self, engine_urls: list[str], output_dir: str) -> None:
        self.sender.setup(engine_urls, output_dir, self.host)

    def push_weights(self, version: int) -> None:
        self.sender.push(version)

    def save(self, folder: str) -> None:
        self.trainer.save(Path(folder))

    def load(self, folder: str) -> None:
        self.trainer.load(Path(folder))

    def export_hf(self, folder: str) -> None:
        self.sender.export_hf(self.trainer.model_path, Path(folder))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class CriticWorker:
    """One rank of a critic with a layout of its own (``train.critic.parallel``): its own megatron world, placed
    on the actor's bundles. Built empty like `TrainerWorker`, then `start`."""

    def __init__(self, cfg: Config, host: str | None = None):
        self.cfg = cfg
        self.host = host or node_ip()
        self.trainer: Any = None

    address = TrainerWorker.address
    node = TrainerWorker.node

    def start(self, rank: int, world: int, master_addr: str, master_port: int) -> None:
        join_ranks(rank, world, master_addr, master_port, self.host)
        from rlx.plugins import build_plugins
        from rlx.train.ppo import CriticTrainer

        self.trainer = CriticTrainer(self.cfg, build_plugins(), master_addr)

    set_threads = TrainerWorker.set_threads
    wait_policy = TrainerWorker.wait_policy
    cpu_seconds = TrainerWorker.cpu_seconds

    def values(self, batch: Any) -> Any:
        return self.trainer.values(batch)

    def train_critic(self, batch: Any, returns: Any, values: Any) -> dict[str, float]:
        return self.trainer.train(batch, returns, values)

    def save(self, folder: str) -> None:
        self.trainer.save(Path(folder))

    def load(self, folder: str) -> None:
        self.trainer.load(Path(folder))

    def close(self) -> None:
        pass


class TrainerGroup(ABC):
    """Every trainer rank, called at once: the typed interface the loop uses. Subclasses say how a
    method reaches the ranks (`_all`)."""

    @abstractmethod
    def _all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every rank with `args`; the results in rank order."""

    def hosts(self) -> list[str]:
        """Each rank's address, in rank order."""
        return self._all("node")

    def set_threads(self, threads: list[int]) -> None:
        """Torch threads for each rank (`rlx.cores`), in rank order."""
        self._each("set_threads", threads)

    def wait_policies(self) -> list[str]:
        """Each rank's OpenMP wait policy, as its process started."""
        return self._all("wait_policy")

    def cpu_seconds(self) -> list[tuple[str, float]]:
        """Each rank's process (host and PID) and the CPU seconds it has used."""
        return self._all("cpu_seconds")

    @abstractmethod
    def _each(self, method: str, args: list[Any]) -> None:
        """Call `method` on rank r with ``args[r]``."""

    def train_step(self, batch: Any) -> dict[str, float]:
        """Train on the batch; the metrics (global: every rank returns the same)."""
        return self._all("train_step", batch)[0]

    def setup_transport(self, engine_urls: list[str], output_dir: str) -> None:
        self._all("setup_transport", engine_urls, output_dir)

    def push_weights(self, version: int) -> None:
        self._all("push_weights", version)

    def save(self, folder: Path) -> None:
        self._all("save", str(folder))

    def load(self, folder: Path) -> None:
        self._all("load", str(folder))

    def export_hf(self, folder: Path) -> None:
        self._all("export_hf", str(folder))

    def close(self) -> None:
        self._all("close")

    def shutdown(self) -> None:
        pass


class LocalTrainerGroup(TrainerGroup):
    """One rank in this process: the same calls as the Ray group, without Ray."""

    def __init__(self, cfg: Config):
        from rlx.rollout.engines.launch import HOST

        if cfg.train.parallel.world_size != 1:
            raise RLXError("train.parallel.world_size > 1 needs Ray (set ray.enabled: true)")
        self.worker = TrainerWorker(cfg, HOST)
        self.worker.start(0, 1, *self.worker.address())

    def _all(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def _each(self, method: str, args: list[Any]) -> None:
        (arg,) = args
        getattr(self.worker, method)(arg)


class RayTrainerGroup(TrainerGroup):
    """`world_size` TrainerWorker actors in a placement group (rank r on bundle r); rank 0's node hosts the
    rendezvous. With ``role="critic"``: the critic's own ranks (`CriticWorker`, ``train.critic.parallel``), on
    the same bundles as the actor's."""

    def __init__(self, cfg: Config, placement_group: Any, first_bundle: int, role: str = "trainer"):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rc = cfg.ray
        self.role = role
        critic = cfg.train.critic.parallel
        world = critic.world_size if role == "critic" else cfg.train.parallel.world_size
        other = 0 if cfg.train.critic.placement == "own" else (  # ranks of the other role on the same bundles
            cfg.train.parallel.world_size if role == "critic" else critic.world_size if critic else 0)
        actor = ray.remote(num_cpus=rc.cpus_per_trainer)(CriticWorker if role == "critic" else TrainerWorker)
        env = process_env(cfg.train.mode, cfg.train.async_cores)  # before the process loads torch (rlx.cores)
        self.workers = [
            actor.options(num_gpus=rc.gpus_per_trainer / (2 if rank < other else 1),  # a GPU shared by two roles
                          **({"runtime_env": {"env_vars": env}} if env else {}),
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              placement_group, placement_group_bundle_index=first_bundle + rank)).remote(cfg)
            for rank in range(world)
        ]
        try:
            addr, port = ray.get(self.workers[0].address.remote())
            ray.get([w.start.remote(rank, world, addr, port) for rank, w in enumerate(self.workers)])
        except ray.exceptions.RayActorError as e:
            raise RLXError(f"a {role} worker failed to start: {e}") from None
        except ray.exceptions.RayTaskError as e:
            _reraise(e)

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        refs = [getattr(w, method).remote(*args) for w in self.workers]
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            _reraise(e)
        except ray.exceptions.RayActorError as e:
            raise TrainerDied(self._dead_rank(refs, e), method, e, self.role) from None

    def _each(self, method: str, args: list[Any]) -> None:
        import ray

        ray.get([getattr(w, method).remote(a) for w, a in zip(self.workers, args, strict=True)])

    @staticmethod
    def _dead_rank(refs: list[Any], error: Any) -> int | None:
        """Which rank's call failed because its actor died (the others may still wait in a collective)."""
        import ray

        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as e:
                if getattr(e, "actor_id", None) == getattr(error, "actor_id", None):
                    return rank
            except Exception:  # noqa: BLE001 - still running (a timeout) or failed otherwise: not this one
                continue
        return None

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)


class CriticTrainerGroup(TrainerGroup):
    """The actor's ranks and a critic's ranks of its own (``train.critic.parallel``), as one trainer group: each
    step the critic's values, the actor's advantages and returns, the critic's update, then the actor's. Weight
    pushes and HF export are the actor's; checkpoints hold both."""

    def __init__(self, actor: TrainerGroup, critic: TrainerGroup):
        self.actor, self.critic = actor, critic

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self.actor._all(method, *args)

    def _each(self, method: str, args: list[Any]) -> None:
        self.actor._each(method, args)

    def set_threads(self, threads: list[int]) -> None:
        """Actor ranks first, then the critic's."""
        n = len(self.actor.workers)
        self.actor.set_threads(threads[:n])
        self.critic.set_threads(threads[n:])

    def wait_policies(self) -> list[str]:
        return self.actor.wait_policies() + self.critic.wait_policies()

    def cpu_seconds(self) -> list[tuple[str, float]]:
        return self.actor.cpu_seconds() + self.critic.cpu_seconds()

    def train_step(self, batch: Any) -> dict[str, float]:
        values = self.critic._all("values", batch)[0]
        returns = self.actor._all("ppo_prepare", batch, values)[0]
        metrics = self.critic._all("train_critic", batch, returns, values)[0]
        return {**metrics, **self.actor._all("ppo_train_actor")[0]}

    def save(self, folder: Path) -> None:
        self.actor.save(folder)
        self.critic.save(folder)

    def load(self, folder: Path) -> None:
        self.actor.load(folder)
        self.critic.load(folder)

    def close(self) -> None:
        self.actor.close()
        self.critic.close()

    def shutdown(self) -> None:
        self.actor.shutdown()
        self.critic.shutdown()


def ray_trainer_group(cfg: Config, placement_group: Any) -> TrainerGroup:
    """The run's trainer ranks in its placement group: the actor's, and the critic's when it has a layout of
    its own (on the actor's bundles, or on bundles of its own after them: ``train.critic.placement``)."""
    actor = RayTrainerGroup(cfg, placement_group, 0)
    if cfg.train.critic.parallel is None:
        return actor
    try:
        first = 0 if cfg.train.critic.placement == "shared" else cfg.train.parallel.world_size
        return CriticTrainerGroup(actor, RayTrainerGroup(cfg, placement_group, first, role="critic"))
    except BaseException:
        actor.shutdown()
        raise


class TrainerDied(RLXError):
    """A trainer rank's process died (killed, out of memory, crashed): one line with the rank, where it ran
    and Ray's reason, instead of Ray's traceback."""

    def __init__(self, rank: int | None, method: str, error: Any, role: str = "trainer"):
        import re

        text = str(getattr(error, "error_msg", "") or error)
        pid = re.search(r"\bpid: (\d+)", text)
        ip = re.search(r"\bip: (\S+)", text)
        detail = re.search(r"Worker exit type: (\S+) Worker exit detail: ([^.]*\.)", text)
        where = f" (pid {pid.group(1)} on {ip.group(1)})" if pid and ip else ""
        why = f"{detail.group(1)}: {detail.group(2)}" if detail else text.splitlines()[0] if text else "unknown"
        who = f"{role} rank {rank}" if rank is not None else f"a {role} rank"
        super().__init__(f"{who}{where} died during {method}: {why} Killed by a signal or the OOM killer "
                         f"(check dmesg on that host), or crashed: Ray's worker logs are in /tmp/ray/session_latest/logs there")
        self.rank = rank


def _reraise(e: Any) -> None:
    """A user-facing error raised in a worker is re-raised as itself; anything else as it came."""
    cause = e.cause if isinstance(getattr(e, "cause", None), RLXError) else None
    if cause is not None:
        raise cause from None
    raise e


def launched_engines(cfg: Config) -> int:
    """The engines the run starts (none when it attaches to engines by address)."""
    return sum(g.num_engines for g in cfg.rollout.engines) if not cfg.rollout.external_engines else 0


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
        init = dict(log_to_driver=rc.log_to_driver,
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

    def _place(self, cfg: Config, ray: Any, placement_group: Any, bundles: list[dict[str, float]]) -> None:
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
        their bundles on and each node's CPUs (`rlx.cores`)."""
        import ray
        from ray.util.placement_group import placement_group_table

        from rlx.cores import plan_threads

        node_of = placement_group_table(self.pg)["bundles_to_node_id"]
        cores = {n["NodeID"]: int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n.get("Alive")}
        actors = cfg.train.parallel.world_size
        critics = cfg.train.critic.parallel.world_size if cfg.train.critic.parallel is not None else 0
        first_critic = 0 if cfg.train.critic.placement == "shared" else actors
        trainers = [*range(actors), *range(first_critic, first_critic + critics)]
        rc = cfg.ray
        return plan_threads(cfg.train.mode, cores, [node_of[b] for b in trainers],
                            [node_of[b] for b in self.engine_bundles], rc.cpus_per_trainer, rc.cpus_per_engine,
                            cfg.train.threads, cfg.train.async_cores)

    def engine_spawner(self, cfg: Config):
        """A function making engine processes inside Ray actors placed on the engine bundles."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rc = cfg.ray
        gpus = 0.0 if self.colocated else rc.gpus_per_engine
        actor = ray.remote(num_cpus=rc.cpus_per_engine, num_gpus=gpus)(EngineHost)
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


@contextlib.contextmanager
def stderr_to(log_path: Path | None):
    """Send this process's standard error (the file descriptor: Ray's driver writes from C++ as well as
    Python while it connects) to `log_path` for the block; None leaves it alone."""
    if log_path is None:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def start_head(num_cpus: int | None, log_dir: Path, init: dict[str, Any]):
    """A Ray head for this run: ``ray start --head --block`` as a child that dies with this process.

    Not ``ray.init()``'s built-in local cluster: if the driver is killed with SIGKILL, that cluster's
    per-node agents outlive it. ``ray start --block`` stops everything it started when it gets SIGTERM,
    which it does when this process dies (PR_SET_PDEATHSIG) or stops it. Returns the head process,
    with this process connected to it (``ray.init(**init)``).
    """
    import shutil
    import sys
    import time

    import ray

    from rlx.rollout.engines.launch import HOST, ManagedProcess, free_port

    port = free_port()
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    cmd = [ray_bin, "start", "--head", "--block", f"--port={port}", f"--node-ip-address={HOST}",
           "--include-dashboard=false", "--disable-usage-stats", f"--dashboard-agent-listen-port={free_port()}"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    head = ManagedProcess(cmd, log_dir / "ray-head.log")
    run_token_auth()
    try:
        # Ray drains a node for 30 s on SIGTERM (for Serve replicas to move); this cluster is the run's own and
        # its work is over when it is stopped: no drain, so a run ends (or fails) without a 30 s wait.
        head.start(env={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
        address = f"{HOST}:{port}"
        deadline = time.monotonic() + 120
        while True:
            if not head.alive():
                raise RLXError(f"ray start exited with code {head.returncode}; log {head.log_path}:\n"
                               f"{head.log_tail()}")
            try:
                ray.init(address=address, **init)
                return head
            except (ConnectionError, RuntimeError):
                if time.monotonic() > deadline:
                    raise RLXError(f"the Ray head at {address} did not come up in 120s; log {head.log_path}") from None
                time.sleep(0.5)
    except BaseException:
        head.stop()
        end_token_auth()
        raise


_saved_auth: dict[str, str | None] | None = None  # the environment `run_token_auth` replaced, until `end_token_auth`


def run_token_auth() -> None:
    """Token authentication for the run's own Ray cluster, with a token of its own, unless ``RAY_AUTH_MODE`` is set.

    Ray (2.5x-2.6x) turns 127.0.0.1 into the machine's network address when it has one, so the head listens
    there. ``ray start`` then enables token authentication by itself when a token file exists
    (``~/.ray/auth_token``, written by any earlier ``ray.init()`` that started a local cluster), while
    ``ray.init(address=...)`` does not: the driver is refused ("Authentication token is missing or incorrect")
    and retries forever. Setting the mode and a fresh token in this process's environment, which the head, its
    workers and this driver share, makes both ends agree and keeps the cluster closed to others on the network.
    `end_token_auth` puts the environment back when the cluster is gone.
    """
    import secrets

    global _saved_auth
    if "RAY_AUTH_MODE" in os.environ:  # the user's choice (with their token), for both ends
        return
    _saved_auth = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _refresh_ray_auth()


def end_token_auth() -> None:
    """Undo `run_token_auth` (nothing if it set nothing): a later cluster in this process gets its own settings."""
    global _saved_auth
    if _saved_auth is None:
        return
    for key, value in _saved_auth.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _saved_auth = None
    _refresh_ray_auth()


def _refresh_ray_auth() -> None:
    try:  # Ray caches its config and token; refresh both (what ray.init does when it enables auth)
        from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader
        from ray._raylet import Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # another Ray layout: it reads the environment when it connects
        pass


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

    def __init__(self, host: Any, log_path: Path):
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
        """The engine process's `rlx.cores.process_identity`, asked of its host once."""
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

