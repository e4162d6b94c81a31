"""The trainer side of a run as rank workers, and the typed groups the loop drives them through.

`TrainerWorker` is one Megatron rank with everything that must happen next to the weights: a training
step, pushing weights into the engines through the transport (one sender per pipeline stage; the
tensor-parallel ranks take part in gathering each tensor), checkpoints and HF export. It is a plain
class: `TrainerGroup` is the typed interface the loop calls, in process when Ray is off
(`LocalTrainerGroup`) or over Ray actors placed with a placement group (`RayTrainerGroup`). Addresses
come from Ray: rank 0's node hosts the trainers' rendezvous, each sender offers its own node's address.
Where the ranks go is `rlx.orchestrate.placement`.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rlx.config import Config, adapter_pushes
from rlx.cpu.threads import process_env
from rlx.errors import RLXError
from rlx.net import node_ip, use_interface_of
from rlx.types import RolloutBatch

if TYPE_CHECKING:
    import torch
    from ray.util.placement_group import PlacementGroup

    Tensors = dict[int, torch.Tensor]  # per sample id: a critic's values or targets


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
    """One trainer rank. ``role="trainer"``: the trainer (the actor, its reference model, and the critic when it
    shares the actor's ranks) and the sending side of weight sync; ``role="critic"``: a rank of a critic with a
    layout of its own (``train.critic.parallel``), in its own megatron world on the actor's bundles. Built empty
    so that Ray can place it first; `start` then joins the ranks at the address rank 0 reported (`address`)."""

    def __init__(self, cfg: Config, host: str | None = None, role: str = "trainer"):
        self.cfg = cfg  # already validated, paths absolute: workers never re-read or re-resolve it
        self.host = host or node_ip()
        self.role = role
        self.trainer: Any = None
        self.sender: Any = None
        self.writes: Any = None  # a checkpoint being written in the background (`save`)

    def address(self) -> tuple[str, int]:
        """Where rank 0 holds the trainers' rendezvous: this node's address and a port free on it."""
        from rlx.net import free_port

        return self.host, free_port(self.host)

    def start(self, rank: int, world: int, master_addr: str, master_port: int) -> None:
        join_ranks(rank, world, master_addr, master_port, self.host)
        from rlx.plugins import process_plugins
        from rlx.train.ppo import CriticTrainer
        from rlx.train.trainer import Trainer
        from rlx.transport.sender import WeightSender

        from rlx.train.megatron_patches.checkpoint import BackgroundWrites

        self.writes = BackgroundWrites()
        plugins = process_plugins()
        if self.role == "critic":
            self.trainer = CriticTrainer(self.cfg, plugins, master_addr)
            return
        self.trainer = Trainer(self.cfg, plugins, master_addr)
        ws = self.cfg.weight_sync
        self.sender = WeightSender(self.trainer, plugins, ws.transport, ws.verify, ws.verify_full_interval,
                                   engine_for=functools.partial(weight_target, timeout_s=ws.timeout_s),
                                   quantization=self.cfg.rollout.quantization, adapters=adapter_pushes(self.cfg))

    def node(self) -> str:
        return self.host

    def set_threads(self, n: int) -> None:
        from rlx.cpu.threads import set_threads

        set_threads(n)

    def wait_policy(self) -> str:
        """The OpenMP wait policy this process started with (`rlx.cpu.threads.process_env`)."""
        return os.environ.get("OMP_WAIT_POLICY", "unset")

    def cpu_seconds(self) -> tuple[str, float]:
        """(this process's identity, its CPU seconds): ranks in the driver's own process count once."""
        from rlx.cpu.meter import process_cpu

        return process_cpu()

    def train_step(self, batch: RolloutBatch) -> dict[str, float | None]:
        self.finish_save(wait=False)
        return self.trainer.train_step(batch)

    def train_actor(self, batch: RolloutBatch, values: Tensors) -> tuple[dict[str, float | None], Tensors]:  # + critic
        self.finish_save(wait=False)
        return self.trainer.train_actor(batch, values)

    def values(self, batch: RolloutBatch) -> Tensors:  # a critic rank's
        self.finish_save(wait=False)
        return self.trainer.values(batch)

    def train_critic(self, batch: RolloutBatch, returns: Tensors, values: Tensors) -> dict[str, float]:  # a critic's
        self.finish_save(wait=False)
        return self.trainer.train(batch, returns, values)

    def setup_transport(self, engine_urls: list[str], output_dir: str) -> None:
        self.sender.setup(engine_urls, output_dir, self.host)

    def push_weights(self, version: int, adapters: dict[str | None, str] | None = None, again: bool = False) -> int:
        """Push (`WeightSender.push`); the bytes this rank sent."""
        return self.sender.push(version, adapters, again)

    def save(self, folder: str, background: bool = False) -> None:
        """The trainer's checkpoint into `folder`; `background`: its tensors copied now and written while the rank
        trains on, whole once every rank's files are: the first training call after that finalises it (or any
        other call of the checkpoint's, such as `finish_save`, waiting for the files)."""
        self.finish_save()
        self.trainer.save(Path(folder), self.writes if background else None)
        if background:
            self.writes.start()

    def finish_save(self, wait: bool = True) -> None:
        if self.writes is not None:
            self.writes.finish(wait)

    def load(self, folder: str) -> None:
        self.finish_save()
        self.trainer.load(Path(folder))

    def export_hf(self, folder: str) -> None:
        from rlx.train.export import export_hf

        self.finish_save()
        export_hf(self.trainer, Path(folder))

    def close(self) -> None:
        self.finish_save()
        if self.sender is not None:
            self.sender.close()


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
        """Torch threads for each rank (`rlx.cpu`), in rank order."""
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

    def train_step(self, batch: RolloutBatch) -> dict[str, float | None]:
        """Train on the batch; the metrics (global: every rank returns the same)."""
        return self._all("train_step", batch)[0]

    def setup_transport(self, engine_urls: list[str], output_dir: str) -> None:
        self._all("setup_transport", engine_urls, output_dir)

    def push_weights(self, version: int, adapters: dict[str | None, str] | None = None, again: bool = False) -> int:
        """Push the trainer's weights as `version` (with adapter pushes, its LoRA adapters, each under the name
        `adapters` gives it: None the one adapter, multi-LoRA's by name; `again`: those pushed last); the bytes
        sent."""
        return sum(self._all("push_weights", version, adapters, again))

    def save(self, folder: Path, background: bool = False) -> None:
        self._all("save", str(folder), background)

    def finish_save(self) -> None:
        """A background `save`, whole (every rank's files and the checkpoint's metadata written)."""
        self._all("finish_save")

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
    rendezvous. With ``role="critic"``: the critic's own ranks (``train.critic.parallel``), on the same bundles as
    the actor's."""

    def __init__(self, cfg: Config, placement_group: PlacementGroup, first_bundle: int, role: str = "trainer"):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rc = cfg.ray
        self.role = role
        critic = cfg.train.critic.parallel
        if role == "critic" and critic is None:
            raise RLXError("a critic trainer group needs train.critic.parallel")
        world = critic.world_size if critic is not None and role == "critic" else cfg.train.parallel.world_size
        other = 0 if cfg.train.critic.placement == "own" else (  # ranks of the other role on the same bundles
            cfg.train.parallel.world_size if role == "critic" else critic.world_size if critic else 0)
        actor: Any = ray.remote(num_cpus=rc.cpus_per_trainer)(TrainerWorker)  # Ray's types lack .remote
        env = process_env(cfg.train.mode, cfg.cpu.async_cores)  # before the process loads torch (rlx.cpu)
        self.workers: list[Any] = [  # Ray actor handles
            actor.options(num_gpus=rc.gpus_per_trainer / (2 if rank < other else 1),  # a GPU shared by two roles
                          **({"runtime_env": {"env_vars": env}} if env else {}),
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              placement_group, placement_group_bundle_index=first_bundle + rank)).remote(
                cfg, role=role)
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
    def _dead_rank(refs: list[Any], error: BaseException) -> int | None:
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
    step the critic's values, then the actor's advantages and update (which return the critic's targets), then the
    critic's update; the two updates are independent, so the order is the one that keeps no state between calls. Weight
    pushes and HF export are the actor's; checkpoints hold both."""

    def __init__(self, actor: RayTrainerGroup, critic: RayTrainerGroup):
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

    def train_step(self, batch: RolloutBatch) -> dict[str, float | None]:
        values = self.critic._all("values", batch)[0]
        metrics, returns = self.actor._all("train_actor", batch, values)[0]
        return {**self.critic._all("train_critic", batch, returns, values)[0], **metrics}

    def save(self, folder: Path, background: bool = False) -> None:
        self.actor.save(folder, background)
        self.critic.save(folder, background)

    def finish_save(self) -> None:
        self.actor.finish_save()
        self.critic.finish_save()

    def load(self, folder: Path) -> None:
        self.actor.load(folder)
        self.critic.load(folder)

    def close(self) -> None:
        self.actor.close()
        self.critic.close()

    def shutdown(self) -> None:
        self.actor.shutdown()
        self.critic.shutdown()


def ray_trainer_group(cfg: Config, placement_group: PlacementGroup) -> TrainerGroup:
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

    def __init__(self, rank: int | None, method: str, error: BaseException, role: str = "trainer"):
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


def _reraise(e: BaseException) -> NoReturn:
    """A user-facing error raised in a worker is re-raised as itself; anything else as it came."""
    cause = getattr(e, "cause", None)  # a Ray task error's: what the worker raised
    if isinstance(cause, RLXError):
        raise cause from None
    raise e
