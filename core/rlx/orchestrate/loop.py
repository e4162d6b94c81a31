"""The RL loop: rollout, train, push weights, log, checkpoint. Reads top to bottom.

Trainer ranks are Ray actors in a placement group (or, with ``ray.enabled: false``, one rank in this
process), driven through the typed `TrainerGroup`; engines are server processes behind the router,
reached over SGLang's HTTP API. Weights go from the trainer ranks that hold them (one per pipeline
stage) straight into the engines through the configured transport (`rlx.transport`).

Sync and async training are this same loop: `rlx.rollout.batches` decides whether a step's batch is
generated after the previous train step (sync) or streamed while it ran (async), and how the
engines' requests behave during a weight swap. The trainer is called off the event loop, so in async
mode the rollout stream keeps generating while it trains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.config import Config
from rlx.errors import Interrupted
from rlx.orchestrate.workers import TrainerDied
from rlx.orchestrate import checkpoint
from rlx.orchestrate.metrics import MetricsLog
from rlx.protocols import RunInfo
from rlx.rollout.batches import BatchSource, batch_source
from rlx.rollout.session import RolloutSession

if TYPE_CHECKING:
    from rlx.orchestrate.workers import TrainerGroup


async def train(cfg: Config, plugins: Any, *, resume: bool = False, save_hf: Path | None = None,
                progress: Callable[[int, dict[str, Any]], None] | None = None, verbose: bool = False) -> Path:
    out = Path(cfg.run.output_dir)
    ckpt_root = out / "checkpoints"
    save_hf = save_hf.resolve() if save_hf is not None else None  # workers run in other folders
    if resume:  # before anything starts: nothing to resume is an error in a second, not after Ray and engines
        checkpoint.resume_folder(ckpt_root)
    for line in objective_notes(cfg, plugins):
        print(f"rlx: note: {line}", file=sys.stderr, flush=True)
    stop = StopRequest()
    try:
        return await _train(cfg, plugins, out, ckpt_root, stop, resume=resume, save_hf=save_hf,
                            progress=progress, verbose=verbose)
    except asyncio.CancelledError:
        if stop.signum is None:
            raise
        raise Interrupted(f"stopped at once by a second {stop.name}; nothing saved since the last checkpoint "
                          f"(continue with rl train CONFIG --resume)", stop.signum) from None
    finally:
        stop.close()


async def _train(cfg: Config, plugins: Any, out: Path, ckpt_root: Path, stop: StopRequest, *, resume: bool,
                 save_hf: Path | None, progress: Callable[[int, dict[str, Any]], None] | None,
                 verbose: bool) -> Path:
    placement = await asyncio.to_thread(place, cfg, verbose)
    # the trainer ranks start (imports, model build) while the engines do: each takes seconds, mostly on one core
    starting = asyncio.get_running_loop().run_in_executor(None, make_trainers, cfg, placement)  # starts now
    trainer: TrainerGroup | None = None
    loggers: list[Any] = []
    try:
        if shares_gpu(cfg):  # engines size their KV cache by the memory they find free: the trainers' must be taken
            trainer = await asyncio.shield(starting)
        loggers += [plugins.build("loggers", spec) for spec in cfg.run.loggers]
        spawn = placement.engine_spawner(cfg) if placement else None
        async with RolloutSession(cfg, plugins, spawn, with_data=cfg.rollout.source == "generate") as session:
            # shielded: a second Ctrl-C here must not drop the group the thread is still making (the finally
            # below waits for it and shuts it down)
            trainer = trainer or await asyncio.shield(starting)
            write_placement(out, await asyncio.to_thread(trainer.hosts), [e.url for e in session.fleet.engines])
            weights = Weights(trainer, session.fleet, out)
            await weights.setup()
            batches = await make_batches(cfg, session, plugins)
            start, version, run_id = 1, 0, checkpoint.new_run_id()
            if resume:
                folder, rollout_state, meta = checkpoint.load_latest(ckpt_root)
                await asyncio.to_thread(trainer.load, folder)
                batches.load_state_dict(rollout_state)
                start, version = meta["step"] + 1, meta["version"]
                weights.version = version
                run_id = meta.get("run_id", run_id)
                # the engines started from the original weights
                await weights.push(version)
            log = MetricsLog(out, resume_step=start - 1 if resume else None)
            run_info = RunInfo(cfg.run.name, out, cfg.to_data(), start - 1 if resume else None)
            for logger in loggers:
                logger.open(run_info)
            watch = DiffWatch()
            evals = Evals(cfg, plugins, session, loggers, out) if cfg.eval.datasets else None
            if evals and cfg.eval.at_start and not resume:
                await evals.run(0)  # the initial policy, before anything trains
            # where a trainer restart with no checkpoint of this run yet starts over from
            initial = session.manager.state_dict() if session.manager is not None else {}
            batches.start()

            saved = start - 1
            restarts, step = 0, start
            try:
                while step <= cfg.train.num_steps:
                    if stop.signum is not None:
                        if saved < step - 1:  # a checkpoint of what trained since the last one
                            checkpoint.save(ckpt_root, step - 1, trainer, await batches.state_dict(),
                                            {"version": version, "run_id": run_id}, keep=cfg.train.checkpoint.keep)
                            saved = step - 1
                        where = f"checkpoint step_{saved} saved" if saved >= 1 else "nothing trained yet"
                        raise Interrupted(f"stopped by {stop.name} after step {step - 1}; {where} (continue with "
                                          f"rl train CONFIG --resume)", stop.signum)
                    try:
                        batch, record = await one_step(cfg, batches, weights, step, version,
                                                       evals.wait if evals else None)
                        record["trainer/restarts"] = float(restarts)
                        if evals:  # the previous evaluation, logged at its own step, before this one
                            await evals.wait()
                        version = record["weight_version"]
                        plugins.on_train_step_end(step, record)
                        warning = watch.see(step, record.get("train_rollout_logprob_diff"))
                        if warning:
                            print(f"rlx: warning: {warning}", file=sys.stderr, flush=True)
                        log.write(record, [s.sample_id for g in batch.groups for s in g.trainable])
                        rows = (sample_rows(batch) if step % cfg.run.log_samples_interval == 0 or step == start
                                else None)
                        for logger in loggers:
                            logger.log_metrics(step, record)
                            if rows:
                                logger.log_samples(step, rows)
                        if progress is not None:
                            progress(step, record)
                        every = cfg.train.checkpoint.interval
                        if (every and step % every == 0) or step == cfg.train.num_steps:
                            checkpoint.save(ckpt_root, step, trainer, await batches.state_dict(),
                                            {"version": version, "run_id": run_id}, keep=cfg.train.checkpoint.keep)
                            saved = step
                    except TrainerDied as died:
                        if placement is None or restarts >= cfg.train.max_restarts:
                            raise
                        restarts += 1
                        trainer, step, version = await restart_trainers(
                            cfg, placement, trainer, weights, batches, ckpt_root, run_id, initial, died, restarts)
                        log = MetricsLog(out, resume_step=step - 1)
                        saved = step - 1
                        continue
                    if evals and cfg.eval.interval and step % cfg.eval.interval == 0:
                        evals.start(step)  # runs beside the next step's rollout, on these weights
                    step += 1
                if evals:
                    await evals.wait()
            finally:
                if evals:
                    evals.cancel()
                await batches.close()
            if save_hf is not None:
                await asyncio.to_thread(trainer.export_hf, save_hf)
            await asyncio.to_thread(trainer.close)
    finally:
        for logger in loggers:
            logger.close()
        if trainer is None:  # the engines failed to start, or the trainers did: a thread cannot be cancelled
            trainer = await _started(starting)
        if trainer is not None:
            trainer.shutdown()
        if placement is not None:
            placement.shutdown()
    return out


def shares_gpu(cfg: Config) -> bool:
    """Whether trainer ranks and engines may use the same GPU (colocated on Ray's bundles, or one process without
    Ray on a machine with one)."""
    if cfg.ray.enabled:
        return cfg.ray.placement == "colocated" and cfg.ray.gpus_per_trainer > 0
    import torch

    return torch.cuda.is_available()


async def _started(starting: asyncio.Future) -> TrainerGroup | None:
    """The trainer group `starting` makes once it has finished (to shut it down), or None if making it failed."""
    try:
        return await asyncio.shield(starting)
    except BaseException:  # noqa: BLE001 - its error, if any, is already on its way up (or a second one is not)
        return None


async def restart_trainers(cfg: Config, placement: Any, trainer: TrainerGroup, weights: Weights,
                           batches: BatchSource, ckpt_root: Path, run_id: str, initial: dict[str, Any],
                           died: Exception, restarts: int) -> tuple[TrainerGroup, int, int]:
    """``train.max_restarts``: a trainer rank died. Start the trainer group again in the same placement group,
    load this run's newest checkpoint (or start over), rewind the batches to it and give the engines its
    weights; returns (trainers, the step to go on with, weight version)."""
    from rlx.orchestrate.workers import ray_trainer_group

    print(f"rlx: {died}", file=sys.stderr, flush=True)
    print(f"rlx: restarting the trainers ({restarts} of train.max_restarts {cfg.train.max_restarts})",
          file=sys.stderr, flush=True)
    trainer.shutdown()
    trainer = await asyncio.to_thread(ray_trainer_group, cfg, placement.pg)
    await asyncio.to_thread(set_trainer_threads, cfg, placement, trainer)
    weights.trainer, weights.urls = trainer, None
    await weights.setup()
    folder = checkpoint.newest(ckpt_root)
    meta: dict[str, Any] = {}
    if folder is not None:
        folder, state, meta = checkpoint.load_latest(ckpt_root)
    if meta.get("run_id") == run_id:
        await asyncio.to_thread(trainer.load, folder)
        step, version, where = meta["step"] + 1, meta["version"], f"checkpoint {folder.name}"
    else:  # nothing of this run saved yet: from the start (the trainers start from the model again)
        state, step, version, where = initial, 1, 0, "the start (no checkpoint of this run yet)"
    await batches.rewind(state)
    weights.version = version
    await weights.push(version)  # the engines go back to the weights trained from
    print(f"rlx: trainers restarted from {where}; going on at step {step}", file=sys.stderr, flush=True)
    return trainer, step, version


async def make_batches(cfg: Config, session: RolloutSession, plugins: Any) -> BatchSource:
    """Where batches come from: generated (sync or async), or POSTed to the rollout buffer service."""
    if cfg.rollout.source == "generate":
        return batch_source(cfg, session.manager, session.fleet)
    import sys

    from rlx.data.buffer import BufferBatches, TrajectoryBuffer

    batches = BufferBatches(cfg, TrajectoryBuffer(cfg, session.ctx.tokenizer, plugins), session.fleet,
                            announce=lambda msg: print(msg, file=sys.stderr, flush=True))
    await batches.open()
    return batches


async def one_step(cfg: Config, batches: BatchSource, weights: Weights, step: int,
                   version: int, settle: Callable[[], Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """Get a batch, train on it, push weights when it is time; the batch and the step's metrics.
    `settle`: awaited before the engines' weights or memory change (an evaluation still running on them)."""
    from rlx.cores import CoreMeter

    meter = CoreMeter(weights.trainer.cpu_seconds, lambda: weights.fleet.serving)
    await meter.mark()
    t0 = time.monotonic()
    batch = await batches.next_batch(step, version)
    t1 = time.monotonic()
    await meter.mark()  # phases are timed without the marks' calls
    t1_ = time.monotonic()
    if settle is not None and cfg.rollout.offload_during_train:
        await settle()
    await batches.before_train()
    train_metrics = await weights.train(batch)
    await batches.after_train()
    t2 = time.monotonic()
    await meter.mark()
    t2_ = time.monotonic()
    version += 1  # the trainer's policy version; the engines get it every update_interval steps
    if step % cfg.train.update_interval == 0:
        if settle is not None:
            await settle()
        await batches.swap(lambda: weights.push(version))
    t3 = time.monotonic()
    await meter.mark()
    record: dict[str, Any] = {"step": step, "weight_version": version, **batch.metrics, **train_metrics,
                              **weights.metrics()}
    record.setdefault("kl", None)  # null: no reference model (train.objective.kl_coef is 0)
    record.update({"time/rollout_s": t1 - t0, "time/train_s": t2 - t1_, "time/weight_sync_s": t3 - t2_,
                   "time/step_s": time.monotonic() - t0, **meter.cores(["rollout", "train", "weight_sync"])})
    return batch, record


class StopRequest:
    """Ctrl-C or SIGTERM during `train`: the first stops the run at the end of the step that runs, with a
    checkpoint of what trained since the last one; a second Ctrl-C stops at once (the main task is
    cancelled: engines and trainers are still stopped). Without a main-thread event loop (a run in a
    thread), signals keep their default behaviour."""

    def __init__(self) -> None:
        import signal

        self.signum: int | None = None
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.installed: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.loop.add_signal_handler(sig, self._on, sig)
                self.installed.append(sig)
            except (RuntimeError, ValueError):  # not the main thread
                pass

    @property
    def name(self) -> str:
        import signal

        return {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}.get(self.signum, f"signal {self.signum}")

    def _on(self, sig: int) -> None:
        if self.signum is None:
            self.signum = sig
            print(f"\nrlx: {self.name}: stopping at the end of this step, with a checkpoint "
                  f"(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        elif self.task is not None:
            self.task.cancel()

    def close(self) -> None:
        for sig in self.installed:
            self.loop.remove_signal_handler(sig)
        self.installed = []


class Weights:
    """The trainer's weights and the engines that get them. One trainer call at a time (a train step, a
    push, a catch-up: a restarted engine may need weights while the trainer trains, in async mode). The
    transport follows the serving engines: set up again when one was taken out or came back. A push that
    failed because an engine failed (it fails a health probe now) is done again without that engine."""

    def __init__(self, trainer: TrainerGroup, fleet: Any, out: Path, version: int = 0):
        self.trainer, self.fleet, self.out = trainer, fleet, str(out)
        self.lock = asyncio.Lock()
        self.version = version  # the trainer's policy version: what a catch-up pushes
        self.urls: list[str] | None = None  # where the transport points now
        if fleet.health is not None:
            fleet.health.catch_up = self.catch_up

    async def _point(self, engines: list[Any]) -> None:
        urls = [e.url for e in engines]
        if urls != self.urls:
            await asyncio.to_thread(self.trainer.setup_transport, urls, self.out)
            self.urls = urls

    async def setup(self) -> None:
        async with self.lock:
            await self._point(self.fleet.weight_targets)

    async def train(self, batch: Any) -> dict[str, Any]:
        async with self.lock:
            metrics = await asyncio.to_thread(self.trainer.train_step, batch)
            self.version += 1
            return metrics

    async def push(self, version: int) -> None:
        async with self.lock:
            for attempt in range(3):
                try:
                    await self._point(self.fleet.weight_targets)
                    if not self.urls:  # every engine is out: each gets the weights when it comes back
                        return
                    await asyncio.to_thread(self.trainer.push_weights, version)
                    return
                except Exception as e:
                    health = self.fleet.health
                    if health is None or attempt == 2:
                        raise
                    await health.settle()  # an engine that failed the push fails its probe: taken out
                    if [x.url for x in self.fleet.weight_targets] == self.urls:
                        raise  # every engine still serves: not an engine failure
                    self.urls = None  # set up again, for the engines that serve
                    print(f"rlx: weight push of version {version} failed ({e}); pushing again to the engines "
                          f"that serve", file=sys.stderr, flush=True)

    async def catch_up(self, engines: list[Any], admit: Callable[[], Any]) -> None:
        """Bring `engines` (restarted or back, not yet serving) to the trainer's current weights and let them
        in (`admit`) before the next train step or push can change those weights. The transport is set up
        again even where the engines' addresses are those it points to (an engine back at its old address is a
        new process: what the transport learned of the old one, such as its tensor dtypes, is gone)."""
        async with self.lock:
            self.urls = None
            await self._point(engines)
            await asyncio.to_thread(self.trainer.push_weights, self.version)
            await admit()

    def metrics(self) -> dict[str, float]:
        return self.fleet.health.metrics() if self.fleet.health is not None else {}


class Evals:
    """Evaluation during training (`rlx.rollout.evaluate`): at step 0, and after every ``eval.interval``
    steps as a task beside the next step's rollout (sync) or the rollout stream (async), on the weights of
    the step it evaluates: the next weight push (or engine offload) waits for it. Results go to the loggers
    at the step evaluated, to ``eval.jsonl`` and to the terminal."""

    def __init__(self, cfg: Config, plugins: Any, session: RolloutSession, loggers: list[Any], out: Path):
        from rlx.rollout.evaluate import Evaluator

        self.evaluator = Evaluator(cfg, plugins, session.ctx)
        self.names = [d.name for d in cfg.eval.datasets]
        self.loggers, self.out = loggers, out
        self.task: asyncio.Task | None = None
        self.step = 0

    async def run(self, step: int) -> None:
        self.start(step)
        await self.wait()

    def start(self, step: int) -> None:
        assert self.task is None, "one evaluation at a time"
        self.step = step
        self.task = asyncio.create_task(self.evaluator.run())

    async def wait(self) -> None:
        """Finish the running evaluation, if any, and report it."""
        if self.task is None:
            return
        task, self.task = self.task, None
        metrics, samples = await task
        from rlx.rollout.evaluate import write_rows

        write_rows(self.out, self.step, metrics, samples)
        for logger in self.loggers:
            logger.log_metrics(self.step, metrics)
        parts = []
        for n in self.names:
            parts.append(f"{n} pass@1 {metrics[f'eval/{n}/pass@1']:.3f} reward {metrics[f'eval/{n}/reward_mean']:.3f}")
        print(f"rlx: eval at step {self.step}: " + "; ".join(parts), file=sys.stderr, flush=True)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None


def sample_rows(batch: Any, n: int = 8) -> list[dict[str, Any]]:
    """A few of the step's trained samples as loggers tabulate them."""
    samples = [s for g in batch.groups for s in g.trainable][:n]
    return [{"prompt": s.prompt_text, "response": s.response_text, "reward": s.reward} for s in samples]


class DiffWatch:
    """Warns when the trainer-vs-engine log-prob difference jumps: a sign that the engines serve other
    weights than the trainer holds, sample at another temperature, or that numerics broke."""

    def __init__(self, factor: float = 5.0, floor: float = 0.02, window: int = 10):
        self.factor, self.floor, self.window = factor, floor, window
        self.seen: list[float] = []

    def see(self, step: int, diff: float | None) -> str | None:
        if diff is None:
            return None
        history = sorted(self.seen[-self.window:])
        self.seen.append(diff)
        if not history:
            return None
        median = history[len(history) // 2]
        if diff > self.floor and diff > self.factor * median:
            return (f"step {step}: train_rollout_logprob_diff jumped to {diff:.3g} (median of the last "
                    f"{len(history)} steps {median:.3g})")
        return None


def objective_notes(cfg: Config, plugins: Any) -> list[str]:
    """What a user should know about the objective they configured, before it runs."""
    obj, sampling = cfg.train.objective, cfg.rollout.sampling
    notes = []
    own = getattr(plugins.get("losses", obj.loss.name), "default_norm", None)  # only losses whose paper says
    if own is not None and obj.loss_norm is not None and obj.loss_norm != own:
        notes.append(f"train.objective.loss_norm: {obj.loss_norm} with the {obj.loss.name!r} loss, whose paper "
                     f"averages per {own}: the objective is not the paper's")
    if obj.tis_cap is not None and (sampling.top_p < 1 or sampling.top_k > 0 or sampling.min_p > 0):
        notes.append("rollout.sampling truncates the distribution (top_p/top_k/min_p); engines report log-probs of "
                     "the untruncated one, so importance correction is not exact for the tokens sampled "
                     "(agent requests that set their own top_p are not exact either)")
    return notes


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
    from rlx.orchestrate.workers import RayPlacement

    return RayPlacement(cfg, verbose) if cfg.ray.enabled else None


def make_trainers(cfg: Config, placement: Any) -> TrainerGroup:
    """The trainer group with its threads set: Ray actors in `placement`, or one local rank when it is None."""
    from rlx.orchestrate.workers import LocalTrainerGroup, ray_trainer_group

    trainer = LocalTrainerGroup(cfg) if placement is None else ray_trainer_group(cfg, placement.pg)
    try:
        set_trainer_threads(cfg, placement, trainer)
    except BaseException:
        trainer.shutdown()
        raise
    return trainer


def set_trainer_threads(cfg: Config, placement: Any, trainer: TrainerGroup) -> None:
    """Each trainer rank's torch threads (`rlx.cores`); logged once."""
    from rlx.cores import engine_threads, local_plan, process_env, waits_sleep_here
    from rlx.orchestrate.workers import launched_engines

    engines = launched_engines(cfg)
    local = local_plan(cfg.train.mode, engines, cfg.ray.cpus_per_trainer, cfg.ray.cpus_per_engine, cfg.train.threads,
                       cfg.train.async_cores)
    plan = local if placement is None else placement.thread_plan(cfg)
    # Without Ray the trainer is this process, started before the config was read: if its waiting threads spin,
    # they would hold cores the engines share (spinning waits made sharing slower than splitting), so it keeps
    # what it reserved (rlx.cores).
    spinning_here = (placement is None and cfg.train.mode == "async" and cfg.train.async_cores == "share"
                     and not cfg.train.threads and not waits_sleep_here())
    if spinning_here:
        plan = dataclasses.replace(plan, trainer=local_plan(cfg.train.mode, engines, cfg.ray.cpus_per_trainer,
                                                            async_cores="split").trainer)
    trainer.set_threads(plan.trainer)
    planned = iter(plan.engine or local.engine)
    threads = []  # each embedded engine's: the plan, or its group's server_args.num_threads
    for g in cfg.rollout.engines if engines else []:
        for _ in range(g.num_engines):
            t = next(planned)
            if g.backend == "embedded":
                threads.append(engine_threads(t, g.model_path or cfg.model.path, g.server_args))
    engines_text = f", engines {threads}" if threads else ""
    mode = cfg.train.mode
    if mode == "async":  # how the two phases share a node's cores, and whether waiting threads sleep in each
        mode += f" mode, cores {'shared' if cfg.train.async_cores == 'share' else 'split'}"
        engine_policy = process_env(cfg.train.mode, cfg.train.async_cores).get(
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
