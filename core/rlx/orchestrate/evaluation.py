"""``rl eval``: the config's eval datasets on a policy, outside training.

The policy is the config's ``model.path``, an HF model folder, or an rlx checkpoint
(``<output_dir>/checkpoints/step_N``), which the trainer loads and exports to HF first (into
``<output_dir>/eval_hf/step_N``; one trainer process when the run's trainer is a single rank, without Ray).
The engines of the config's topology serve it; results go to the terminal and ``<output_dir>/eval.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from rlx.config import Config
from rlx.errors import RLXError


def policy_path(cfg: Config, checkpoint: Path | None) -> tuple[str, int, str | None]:
    """(HF model folder to serve, the step it is from, what to record as its source)."""
    if checkpoint is None:
        return cfg.model.path, 0, None
    checkpoint = checkpoint.resolve()
    if (checkpoint / "config.json").is_file():
        return str(checkpoint), 0, str(checkpoint)
    if checkpoint.name == "checkpoints":
        from rlx.orchestrate.checkpoint import newest

        checkpoint = newest(checkpoint) or checkpoint
    meta = checkpoint / "meta.json"
    if not meta.is_file():
        raise RLXError(f"--checkpoint {checkpoint}: neither an HF model folder (config.json) nor an rlx "
                       f"checkpoint (meta.json, as in <output_dir>/checkpoints/step_N)")
    step = int(json.loads(meta.read_text())["step"])
    hf = Path(cfg.run.output_dir) / "eval_hf" / checkpoint.name
    if not (hf / "config.json").is_file():
        export_checkpoint(cfg, checkpoint, hf)
    return str(hf), step, str(checkpoint)


def export_checkpoint(cfg: Config, checkpoint: Path, hf: Path) -> None:
    """Load an rlx checkpoint into the run's trainer and export it as an HF model folder."""
    import warnings

    from rlx.orchestrate.loop import start_trainers
    from rlx.orchestrate.workers import stderr_to

    if cfg.train.parallel.world_size == 1:
        cfg = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"enabled": False})})
    # the trainer's own output (megatron's notes, torch.distributed's C++ warnings) goes to a log, not the terminal
    with warnings.catch_warnings(), stderr_to(Path(cfg.run.output_dir) / "logs" / "eval-export.log"):
        warnings.simplefilter("ignore")
        placement, trainer = start_trainers(cfg)
        try:
            trainer.load(checkpoint)
            trainer.export_hf(hf.resolve())
            trainer.close()
        finally:
            trainer.shutdown()
            if placement is not None:
                placement.shutdown()


async def evaluate(cfg: Config, plugins: Any, checkpoint: Path | None = None) -> tuple[dict[str, float], Path]:
    """Run every eval dataset on the policy; (metrics, path of eval.jsonl)."""
    from rlx.rollout.evaluate import Evaluator, write_rows
    from rlx.rollout.session import RolloutSession

    if not cfg.eval.datasets:
        raise RLXError("eval.datasets: nothing to evaluate (add datasets to the config's eval section)")
    path, step, source = await asyncio.to_thread(policy_path, cfg, checkpoint)
    cfg = cfg.model_copy(deep=True)
    cfg.model.path = path
    for g in cfg.rollout.engines:  # engines that name their own model serve the policy evaluated too
        g.model_path = None
    async with RolloutSession(cfg, plugins, with_data=False) as session:
        metrics, samples = await Evaluator(cfg, plugins, session.ctx).run()
    return metrics, write_rows(Path(cfg.run.output_dir), step, metrics, samples, checkpoint=source or path)
