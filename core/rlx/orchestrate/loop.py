"""The synchronous RL loop: rollout, train, push weights, log, checkpoint. Reads top to bottom.

The trainer runs in this process (one trainer rank; the Megatron code is the same as on a cluster).
Engines are separate processes behind the router, reached over SGLang's HTTP API.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlx.config import Config
from rlx.errors import RLXError
from rlx.orchestrate import checkpoint
from rlx.orchestrate.metrics import MetricsLog
from rlx.rollout.rewards import instantiate
from rlx.rollout.session import RolloutSession
from rlx.transport import verify


async def train(cfg: Config, plugins: Any, *, resume: bool = False, save_hf: Path | None = None,
                progress: Callable[[int, dict[str, Any]], None] | None = None) -> Path:
    from rlx.train.trainer import MegatronTrainer

    out = cfg.resolve_path(cfg.run.output_dir)
    ckpt_root = out / "checkpoints"
    if cfg.train.world_size != 1:
        raise RLXError("train.world_size > 1 needs the Ray launcher, which is not built yet; "
                       "multi-rank Megatron runs under torchrun today (see tests/integration/test_parallel.py)")
    trainer = await asyncio.to_thread(MegatronTrainer, cfg, plugins)
    async with RolloutSession(cfg, plugins) as session:
        targets = session.fleet.weight_targets
        tspec = cfg.train.transport
        transport = instantiate(plugins.get("transports", tspec.name), tspec.args)
        await transport.setup(targets, out)

        async def push(version: int) -> None:
            named = list(trainer.hf_state_dict().items())
            await transport.push(named, version, targets)
            if cfg.train.verify_weights:
                await verify(targets, named, version)

        start, version = 1, 0
        if resume:
            folder, rstate, meta = checkpoint.load_latest(ckpt_root)
            trainer.load(folder)
            session.manager.load_state_dict(rstate)
            start, version = meta["step"] + 1, meta["version"]
            await push(version)  # the engines started from the original weights
        log = MetricsLog(out, resume_step=start - 1 if resume else None)

        for step in range(start, cfg.train.num_steps + 1):
            t0 = time.monotonic()
            batch = await session.manager.next_batch(step, version)
            t1 = time.monotonic()
            train_metrics = await asyncio.to_thread(trainer.train_step, batch)
            t2 = time.monotonic()
            version += 1
            await push(version)
            t3 = time.monotonic()

            record: dict[str, Any] = {"step": step, "weight_version": version, **batch.metrics, **train_metrics}
            record.setdefault("kl", None)  # null: no reference model (train.kl_coef is 0)
            record.update({"time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/weight_sync_s": t3 - t2,
                           "time/step_s": time.monotonic() - t0})
            plugins.on_train_step_end(step, record)
            trained = [s.sample_id for g in batch.groups for s in g.trainable]
            log.write(record, trained)
            if progress is not None:
                progress(step, record)
            every = cfg.train.save_interval
            if (every and step % every == 0) or step == cfg.train.num_steps:
                checkpoint.save(ckpt_root, step, trainer, session.manager.state_dict(), {"version": version})
        await transport.close()
    if save_hf is not None:
        export_hf(trainer, save_hf)
    return out


def export_hf(trainer: Any, folder: Path) -> Path:
    """An HF checkpoint transformers loads: the original config and tokenizer, the trained weights."""
    import shutil

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    src = Path(trainer.model_path)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, folder / f.name)
    state = {k: v.detach().contiguous().cpu() for k, v in trainer.hf_state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
