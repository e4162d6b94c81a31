"""The RL loop: rollout, train, push weights, log, checkpoint. Reads top to bottom.

Trainer ranks are Ray actors in a placement group (or, with ``ray.enabled: false``, one rank in this
process); engines are server processes behind the router, reached over SGLang's HTTP API. Weights go
from trainer rank 0 straight into the engines through the configured transport.

Sync and async training are this same loop: `rlx.rollout.batches` decides whether a step's batch is
generated after the previous train step (sync) or streamed while it ran (async), and how the
engines' requests behave during a weight swap. The trainer is called off the event loop, so in async
mode the rollout stream keeps generating while it trains.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlx.config import Config
from rlx.orchestrate import checkpoint
from rlx.orchestrate.metrics import MetricsLog
from rlx.rollout.batches import BatchSource, batch_source
from rlx.rollout.session import RolloutSession


async def train(cfg: Config, plugins: Any, *, resume: bool = False, save_hf: Path | None = None,
                progress: Callable[[int, dict[str, Any]], None] | None = None) -> Path:
    out = cfg.resolve_path(cfg.run.output_dir)
    ckpt_root = out / "checkpoints"
    placement, trainer = await asyncio.to_thread(start_trainers, absolute_paths(cfg))
    try:
        spawn = placement.engine_spawner(cfg) if placement else None
        async with RolloutSession(cfg, plugins, spawn, with_data=cfg.rollout.source == "generate") as session:
            urls = [e.url for e in session.fleet.weight_targets]
            await call(trainer, "setup_transport", urls, str(out))
            batches = await make_batches(cfg, session, plugins)
            start, version = 1, 0
            if resume:
                folder, rollout_state, meta = checkpoint.load_latest(ckpt_root)
                await call(trainer, "load", str(folder))
                batches.load_state_dict(rollout_state)
                start, version = meta["step"] + 1, meta["version"]
                await call(trainer, "push_weights", version)  # the engines started from the original weights
            log = MetricsLog(out, resume_step=start - 1 if resume else None)
            batches.start()

            try:
                for step in range(start, cfg.train.num_steps + 1):
                    batch, record = await one_step(cfg, batches, trainer, step, version)
                    version = record["weight_version"]
                    plugins.on_train_step_end(step, record)
                    log.write(record, [s.sample_id for g in batch.groups for s in g.trainable])
                    if progress is not None:
                        progress(step, record)
                    every = cfg.train.save_interval
                    if (every and step % every == 0) or step == cfg.train.num_steps:
                        checkpoint.save(ckpt_root, step, _Saver(trainer), await batches.state_dict(),
                                        {"version": version})
            finally:
                await batches.close()
            if save_hf is not None:
                await call(trainer, "export_hf", str(save_hf))
            await call(trainer, "close")
    finally:
        trainer.shutdown()
        if placement is not None:
            placement.shutdown()
    return out


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


async def one_step(cfg: Config, batches: BatchSource, trainer: Any, step: int,
                   version: int) -> tuple[Any, dict[str, Any]]:
    """Get a batch, train on it, push weights when it is time; the batch and the step's metrics."""
    t0 = time.monotonic()
    batch = await batches.next_batch(step, version)
    t1 = time.monotonic()
    await batches.before_train()
    train_metrics = (await call(trainer, "train_step", batch))[0]
    await batches.after_train()
    t2 = time.monotonic()
    version += 1  # the trainer's policy version; the engines get it every update_interval steps
    if step % cfg.train.update_interval == 0:
        await batches.swap(lambda: call(trainer, "push_weights", version))
    t3 = time.monotonic()
    record: dict[str, Any] = {"step": step, "weight_version": version, **batch.metrics, **train_metrics}
    record.setdefault("kl", None)  # null: no reference model (train.kl_coef is 0)
    record.update({"time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/weight_sync_s": t3 - t2,
                   "time/step_s": time.monotonic() - t0})
    return batch, record


def start_trainers(cfg: Config):
    """(placement or None, trainer group): Ray actors when ``ray.enabled``, else one local rank."""
    from rlx.orchestrate.workers import LocalTrainer, RayPlacement, RayTrainerGroup

    if not cfg.ray.enabled:
        return None, LocalTrainer(cfg)
    placement = RayPlacement(cfg)
    try:
        return placement, RayTrainerGroup(cfg, placement.pg, first_bundle=0)
    except BaseException:
        placement.shutdown()
        raise


async def call(trainer: Any, method: str, *args: Any) -> list[Any]:
    """Call `method` on every trainer rank, off the event loop (the rollout side keeps serving)."""
    return await asyncio.to_thread(trainer.call, method, *args)


class _Saver:
    """What `checkpoint.save` needs: every rank writes its part into the folder."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def save(self, folder: Path) -> None:
        self.trainer.call("save", str(folder))


def absolute_paths(cfg: Config) -> Config:
    """A copy whose file paths no longer depend on where the config file was (workers lack it)."""
    cfg = cfg.model_copy(deep=True)
    if "://" not in cfg.model.path:
        cfg.model.path = str(cfg.resolve_path(cfg.model.path))
    if cfg.model.tokenizer and "://" not in cfg.model.tokenizer:
        cfg.model.tokenizer = str(cfg.resolve_path(cfg.model.tokenizer))
    cfg.run.output_dir = str(cfg.resolve_path(cfg.run.output_dir))
    return cfg


def export_hf(model_path: str, state: dict[str, Any], folder: Path) -> Path:
    """An HF checkpoint transformers loads: the original config and tokenizer, the trained weights."""
    import shutil

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in Path(model_path).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, folder / f.name)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder
