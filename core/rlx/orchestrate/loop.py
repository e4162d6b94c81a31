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
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.config import Config
from rlx.cpu.meter import CoreMeter
from rlx.data.replay import ReplayBatches, save_batch
from rlx.errors import Interrupted
from rlx.orchestrate import checkpoint
from rlx.orchestrate.evals import Evals
from rlx.orchestrate.metrics import DiffWatch, MetricsLog, objective_notes
from rlx.orchestrate.placement import (make_trainers, place, ray_trainer_group, set_trainer_threads, shares_gpu,
                                       write_placement)
from rlx.orchestrate.ranks import TrainerDied, TrainerGroup
from rlx.orchestrate.stop import StopRequest
from rlx.orchestrate.weights import Weights
from rlx.protocols import RunInfo
from rlx.rollout.batches import BatchSource, batch_source
from rlx.rollout.session import RolloutSession

if TYPE_CHECKING:
    from rlx.orchestrate.placement import RayPlacement
    from rlx.plugins import Plugins
    from rlx.types import RolloutBatch


async def train(cfg: Config, plugins: Plugins, *, resume: bool = False, save_hf: Path | None = None,
                progress: Callable[[int, dict[str, Any]], None] | None = None, verbose: bool = False) -> Path:
    """Train as ``cfg`` says; returns the run's output folder. `progress(step, record)` after each step."""
    if resume:  # before anything starts: nothing to resume is an error in a second, not after Ray and engines
        done = int(checkpoint.resume_folder(Path(cfg.run.output_dir) / "checkpoints").name.removeprefix("step_"))
        if done >= cfg.train.num_steps and save_hf is None:  # (an export still needs the trainer: it goes on)
            print(f"rlx: nothing to resume: {cfg.run.output_dir} finished, its newest checkpoint is step {done} "
                  f"of train.num_steps {cfg.train.num_steps} (raise train.num_steps to train on)", file=sys.stderr,
                  flush=True)
            return Path(cfg.run.output_dir)
    for line in objective_notes(cfg, plugins):
        print(f"rlx: note: {line}", file=sys.stderr, flush=True)
    save_hf = save_hf.resolve() if save_hf is not None else None  # workers run in other folders
    stop = StopRequest()
    try:
        return await _train(cfg, plugins, stop, resume=resume, save_hf=save_hf, progress=progress, verbose=verbose)
    except asyncio.CancelledError:
        if stop.signum is None:
            raise
        raise Interrupted(f"stopped at once by a second {stop.name}; nothing saved since the last checkpoint "
                          f"(continue with rl train CONFIG --resume)", stop.signum) from None
    finally:
        stop.close()


async def _train(cfg: Config, plugins: Plugins, stop: StopRequest, *, resume: bool, save_hf: Path | None,
                 progress: Callable[[int, dict[str, Any]], None] | None, verbose: bool) -> Path:
    """Start the run's pieces (placement, trainer ranks, loggers, engines), run its steps, and stop the pieces in
    the reverse order, whatever happened."""
    out = Path(cfg.run.output_dir)
    async with contextlib.AsyncExitStack() as stack:
        placement = await asyncio.to_thread(place, cfg, verbose)
        if placement is not None:
            stack.callback(placement.shutdown)
        trainers = Trainers(cfg, placement)  # starting (imports, model build) while the engines do
        stack.push_async_callback(trainers.shutdown)
        if shares_gpu(cfg):  # engines size their KV cache by the memory they find free: the trainers' must be taken
            await trainers.ready()
        loggers = [plugins.build("loggers", spec) for spec in cfg.run.loggers]
        for logger in loggers:
            stack.callback(logger.close)  # (closed last to first)
        spawn = placement.engine_spawner(cfg) if placement else None
        session = await stack.enter_async_context(
            RolloutSession(cfg, plugins, spawn, with_data=cfg.rollout.source == "generate"))
        trainer = await trainers.ready()
        write_placement(out, await asyncio.to_thread(trainer.hosts), [e.url for e in session.fleet.engines])
        served: dict[str | None, Any] | None = None  # (no engines: nothing to serve)
        if session.fleet.engines:
            served = dict(session.ctx.adapters.items()) or {None: session.ctx.adapter}
        weights = Weights(trainer, session.fleet, out, adapters=served)
        stack.push_async_callback(weights.close)
        await weights.setup()
        if session.fleet.health is not None:
            stack.push_async_callback(_cancel, asyncio.create_task(weights.joins()))
        run = Run(cfg, plugins, placement, trainers, weights, await make_batches(cfg, session, plugins), session,
                  loggers, stop, progress)
        await run.begin(resume)
        try:
            await run.steps()
        except Exception:  # the last checkpoint still kept if its files are written (not on a second Ctrl-C)
            await run.saved_whole(failing=True)
            raise
        finally:
            if run.evals:
                run.evals.cancel()
            await run.batches.close()
        await run.saved_whole()
        async with weights.lock:  # (an engine may still be rejoining)
            if save_hf is not None:
                await asyncio.to_thread(run.trainer.export_hf, save_hf)
            await asyncio.to_thread(run.trainer.close)
    return out


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class Run:
    """One run between its start and its end: where it is (step, weight version, last checkpoint, restarts), the
    step loop, and what each step ends with (metrics to the log and loggers, checkpoints, evaluations)."""

    def __init__(self, cfg: Config, plugins: Plugins, placement: RayPlacement | None, trainers: Trainers,
                 weights: Weights, batches: BatchSource, session: RolloutSession, loggers: list[Any],
                 stop: StopRequest, progress: Callable[[int, dict[str, Any]], None] | None):
        self.cfg, self.plugins, self.placement, self.trainers = cfg, plugins, placement, trainers
        self.weights, self.batches, self.session, self.loggers = weights, batches, session, loggers
        self.stop, self.progress = stop, progress
        self.out = Path(cfg.run.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.evals = Evals(cfg, plugins, session, loggers, self.out) if cfg.eval.datasets else None
        self.watch = DiffWatch()
        self.step, self.version, self.run_id, self.restarts = 1, 0, checkpoint.new_run_id(), 0
        self.saving: checkpoint.Saving | None = None  # the last checkpoint, being written

    @property
    def trainer(self) -> TrainerGroup:
        assert self.trainers.group is not None, "the trainers start before the loop"
        return self.trainers.group

    async def begin(self, resume: bool) -> None:
        """From the newest checkpoint (`resume`) or the start: trainer, batches, engines' weights, logs."""
        if resume:
            folder, rollout_state, meta = checkpoint.load_latest(self.ckpt_root)
            await asyncio.to_thread(self.trainer.load, folder)
            self.batches.load_state_dict(rollout_state)
            self.step, self.version = meta["step"] + 1, meta["version"]
            self.run_id = meta.get("run_id", self.run_id)
            self.weights.version = self.version
            await self.weights.push(self.version)  # the engines started from the original weights
        self.first = self.saved = self.step - 1
        self.log = MetricsLog(self.out, resume_step=self.saved if resume else None)
        run_info = RunInfo(self.cfg.run.name, self.out, self.cfg.to_data(), self.saved if resume else None)
        for logger in self.loggers:
            logger.open(run_info)
        if self.evals and self.cfg.eval.at_start and not resume:
            await self.evals.run(0)  # the initial policy, before anything trains
        # where a trainer restart with no checkpoint of this run yet starts over from
        self.initial = self.session.manager.state_dict() if self.session.with_data else {}  # buffer runs: no manager
        self.batches.start()

    async def steps(self) -> None:
        """The loop: rollout, train, push weights (`one_step`), then log, checkpoint, evaluate; until
        ``train.num_steps`` or a stop request."""
        cfg = self.cfg
        while self.step <= cfg.train.num_steps:
            if self.stop.signum is not None:
                await self.stop_here()
            try:
                batch, record = await one_step(cfg, self.plugins, self.batches, self.weights, self.step, self.version,
                                               self.evals.wait if self.evals else None)
                await self.report(batch, record)
                if self.saving is not None and self.saving.written():  # (the ranks finalise it as they train)
                    await self.saved_whole()
                every = cfg.train.checkpoint.interval
                if (every and self.step % every == 0) or self.step == cfg.train.num_steps:
                    await self.save(self.step)
            except TrainerDied as died:
                if self.placement is None or self.restarts >= cfg.train.max_restarts:
                    raise
                await self.restart(died)
                continue
            if self.evals and cfg.eval.interval and self.step % cfg.eval.interval == 0:
                self.evals.start(self.step)  # runs beside the next step's rollout, on these weights
            self.step += 1
        if self.evals:
            await self.evals.wait()

    async def report(self, batch: RolloutBatch, record: dict[str, Any]) -> None:
        """A step's record to metrics.jsonl, the loggers, plugins and `progress`; a few of its samples too."""
        step = self.step
        record["trainer/restarts"] = float(self.restarts)
        if self.evals:  # the previous evaluation, logged at its own step, before this one
            await self.evals.wait()
        self.version = record["weight_version"]
        self.plugins.on_train_step_end(step, record)
        warning = self.watch.see(step, record.get("train_rollout_logprob_diff"))
        if warning:
            print(f"rlx: warning: {warning}", file=sys.stderr, flush=True)
        self.log.write(record, [s.sample_id for g in batch.groups for s in g.trainable])
        rows = sample_rows(batch) if step % self.cfg.run.log_samples_interval == 0 or step == self.first + 1 else None
        for logger in self.loggers:
            logger.log_metrics(step, record)
            if rows:
                logger.log_samples(step, rows)
        if self.progress is not None:
            self.progress(step, record)

    async def save(self, step: int) -> None:
        """A checkpoint of the step just trained; with train.checkpoint.async_save its files are written while the
        next steps run, and it is made whole once they are (`steps`) or when it must be (`saved_whole`)."""
        await self.saved_whole()  # one at a time
        ck = self.cfg.train.checkpoint
        state = await self.batches.state_dict()  # (not under the lock: the rollout may wait for an engine to rejoin)
        async with self.weights.lock:  # no engine's rejoining push between the ranks' collectives
            self.saving = checkpoint.Saving(self.ckpt_root, step, self.trainer, state,
                                            {"version": self.version, "run_id": self.run_id}, ck.keep, ck.async_save)
        self.saved = step
        if self.saving.written():
            await self.saved_whole()

    async def saved_whole(self, failing: bool = False) -> None:
        """The checkpoint being written, whole. `failing`: the run (or a trainer rank) is failing already, and its
        ranks are not called again: the checkpoint is kept only if its files are all written."""
        saving, self.saving = self.saving, None
        if saving is None:
            return
        if failing and not saving.written():
            print(f"rlx: checkpoint step_{saving.step} was still being written: not kept", file=sys.stderr,
                  flush=True)
            return
        try:
            async with self.weights.lock:
                await asyncio.to_thread(saving.finish)
        except Exception as e:
            if not failing:
                raise
            print(f"rlx: checkpoint step_{saving.step} is lost: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    async def stop_here(self) -> None:
        """A stop request: a checkpoint of what trained since the last one, then `Interrupted`."""
        step, signum = self.step, self.stop.signum
        assert signum is not None, "called on a stop request"
        if self.saved < step - 1:
            await self.save(step - 1)
        await self.saved_whole()
        where = f"checkpoint step_{self.saved} saved" if self.saved >= 1 else "nothing trained yet"
        raise Interrupted(f"stopped by {self.stop.name} after step {step - 1}; {where} (continue with "
                          f"rl train CONFIG --resume)", signum)

    async def restart(self, died: TrainerDied) -> None:
        """``train.max_restarts``: a trainer rank died. Start the trainer group again in the same placement
        group, load this run's newest checkpoint (or start over), rewind the batches to it and give the engines
        its weights."""
        cfg = self.cfg
        self.restarts += 1
        print(f"rlx: {died}", file=sys.stderr, flush=True)
        print(f"rlx: restarting the trainers ({self.restarts} of train.max_restarts {cfg.train.max_restarts})",
              file=sys.stderr, flush=True)
        await self.saved_whole(failing=True)  # (a dead rank's part is not written: the folder is dropped)
        self.weights.ready.clear()  # (an engine back meanwhile gets the restarted trainers' weights)
        self.trainer.shutdown()
        assert self.placement is not None, "trainer ranks that can die are Ray actors"
        self.trainers.group = trainer = await asyncio.to_thread(ray_trainer_group, cfg, self.placement.pg)
        await asyncio.to_thread(set_trainer_threads, cfg, self.placement, trainer)
        self.weights.trainer, self.weights.urls = trainer, None
        await self.weights.setup()
        folder = checkpoint.newest(self.ckpt_root)
        meta: dict[str, Any] = {}
        if folder is not None:
            folder, state, meta = checkpoint.load_latest(self.ckpt_root)
        if folder is not None and meta.get("run_id") == self.run_id:
            await asyncio.to_thread(trainer.load, folder)
            step, version, where = meta["step"] + 1, meta["version"], f"checkpoint {folder.name}"
        else:  # nothing of this run saved yet: from the start (the trainers start from the model again)
            state, step, version, where = self.initial, 1, 0, "the start (no checkpoint of this run yet)"
        await self.batches.rewind(state)
        self.step, self.version = step, version
        self.weights.version = version
        await self.weights.push(version)  # the engines go back to the weights trained from
        self.weights.ready.set()
        print(f"rlx: trainers restarted from {where}; going on at step {step}", file=sys.stderr, flush=True)
        self.log = MetricsLog(self.out, resume_step=step - 1)
        self.saved = step - 1


class Trainers:
    """The run's trainer group, made in a thread from the moment the run starts (while the engines start);
    `group` is the current one (a restart replaces it), shut down when the run ends."""

    def __init__(self, cfg: Config, placement: RayPlacement | None):
        self.starting = asyncio.get_running_loop().run_in_executor(None, make_trainers, cfg, placement)
        self.group: TrainerGroup | None = None

    async def ready(self) -> TrainerGroup:
        # shielded: a second Ctrl-C here must not drop the group the thread is still making (`shutdown` waits
        # for it and shuts it down)
        if self.group is None:
            self.group = await asyncio.shield(self.starting)
        return self.group

    async def shutdown(self) -> None:
        if self.group is None:  # the engines failed to start, or the trainers did: a thread cannot be cancelled
            # waited for, not awaited: raising its error again here would rewrite the traceback of the one already
            # on its way up (the thread's frames lost)
            try:
                await asyncio.wait([self.starting])
            except asyncio.CancelledError:  # a second Ctrl-C: stop at once, the thread left to the process's end
                return
            if self.starting.cancelled() or self.starting.exception() is not None:
                return
            self.group = self.starting.result()
        self.group.shutdown()


async def make_batches(cfg: Config, session: RolloutSession, plugins: Plugins) -> BatchSource:
    """Where batches come from: generated (sync or async), saved ones replayed, or POSTed to the rollout buffer
    service."""
    if cfg.rollout.source == "generate":
        return batch_source(cfg, session.manager, session.fleet)
    if cfg.rollout.source == "replay":
        return ReplayBatches(cfg)
    from rlx.data.buffer import BufferBatches, TrajectoryBuffer  # the buffer service's runs only

    batches = BufferBatches(cfg, TrajectoryBuffer(cfg, session.ctx.tokenizer, plugins), session.fleet,
                            announce=lambda msg: print(msg, file=sys.stderr, flush=True))
    await batches.open()
    return batches


async def one_step(cfg: Config, plugins: Plugins, batches: BatchSource, weights: Weights, step: int,
                   version: int, settle: Callable[[], Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """Get a batch (and tell the plugins, ``on_rollout_end``), train on it, push weights when it is time; the
    batch and the step's metrics. `settle`: awaited before the engines' weights or memory change (an evaluation
    still running on them)."""
    meter = CoreMeter(weights.trainer.cpu_seconds, lambda: weights.fleet.serving)
    await meter.mark()
    t0 = time.monotonic()
    batch = await batches.next_batch(step, version)
    if cfg.rollout.save_batches:  # before the plugins' hook, which runs on a replayed batch again
        await asyncio.to_thread(save_batch, batch, Path(cfg.run.output_dir) / "batches")
    plugins.on_rollout_end(batch)
    t1 = time.monotonic()
    await meter.mark()  # phases are timed without the marks' calls
    t1_ = time.monotonic()
    if settle is not None and cfg.rollout.offload_during_train:
        await settle()
    await batches.before_train()
    train_metrics = await weights.train_step(batch)
    await batches.after_train()
    t2 = time.monotonic()
    await meter.mark()
    t2_ = time.monotonic()
    version += 1  # the trainer's policy version; the engines get it every weight_sync.interval steps
    pushed = 0  # the bytes the step's push sent (weight_sync/bytes)
    if step % cfg.weight_sync.interval == 0:
        if settle is not None:
            await settle()

        async def push() -> None:
            nonlocal pushed
            pushed = await weights.push(version)

        await batches.swap(push)
    t3 = time.monotonic()
    await meter.mark()
    record: dict[str, Any] = {"step": step, "weight_version": version, **batch.metrics, **train_metrics,
                              **weights.metrics(), "weight_sync/bytes": float(pushed)}
    record.setdefault("kl", None)  # null: no reference model (train.objective.kl_coef is 0)
    record.update({"time/rollout_s": t1 - t0, "time/train_s": t2 - t1_, "time/weight_sync_s": t3 - t2_,
                   "time/step_s": time.monotonic() - t0, **meter.cores(["rollout", "train", "weight_sync"])})
    return batch, record


def sample_rows(batch: RolloutBatch, n: int = 8) -> list[dict[str, Any]]:
    """A few of the step's trained samples as loggers tabulate them."""
    samples = [s for g in batch.groups for s in g.trainable][:n]
    return [{"prompt": s.prompt_text, "response": s.response_text, "reward": s.reward} for s in samples]
