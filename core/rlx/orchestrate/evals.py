"""Evaluation: during training (`Evals`), and ``rl eval``, the config's eval datasets on a policy outside training.

The policy is the config's ``model.path``, an HF model folder, or an rlx checkpoint
(``<output_dir>/checkpoints/step_N``), which the trainer loads and exports to HF first (into
``<output_dir>/eval_hf/step_N``; one trainer process when the run's trainer is a single rank, without Ray).
The engines of the config's topology serve it; results go to the terminal and ``<output_dir>/eval.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.config import Config
from rlx.errors import RLXError

if TYPE_CHECKING:
    from rlx.plugins import Plugins
    from rlx.rollout.session import RolloutSession


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

    from rlx.orchestrate.placement import start_trainers, stderr_to

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


async def evaluate(cfg: Config, plugins: Plugins, checkpoint: Path | None = None) -> tuple[dict[str, float], Path]:
    """Run every eval dataset on the policy; (metrics, path of eval.jsonl)."""
    from rlx.rollout.evaluator import Evaluator, write_rows
    from rlx.rollout.session import RolloutSession

    if not cfg.eval.datasets:
        raise RLXError("eval.datasets: nothing to evaluate (add datasets to the config's eval section)")
    path, step, source = await asyncio.to_thread(policy_path, cfg, checkpoint)
    cfg = cfg.model_copy(deep=True)
    cfg.model.path = path
    for g in cfg.rollout.engines:  # engines that name their own model serve the policy evaluated too
        g.model_path = None
    async with RolloutSession(cfg, plugins, with_data=False) as session:
        await serve_exported_adapters(cfg, session, Path(path))
        metrics, samples = await Evaluator(cfg, plugins, session.ctx).run()
    return metrics, write_rows(Path(cfg.run.output_dir), step, metrics, samples, checkpoint=source or path)


async def serve_exported_adapters(cfg: Config, session: RolloutSession, folder: Path) -> None:
    """Multi-LoRA: the adapters eval datasets name, as `folder` holds them exported beside the base model
    (``adapter-<name>``, peft's), loaded into the engines, and requests of those datasets naming them."""
    for i, d in enumerate(cfg.eval.datasets):
        if d.adapter is None or session.ctx.adapters[d.adapter].name is not None:
            continue
        adapter = folder / f"adapter-{d.adapter}"
        if not (adapter / "adapter_config.json").is_file():
            raise RLXError(f"eval.datasets[{i}].adapter {d.adapter!r}: {folder} has no {adapter.name} (peft's "
                           f"adapter_config.json); evaluate a multi-LoRA run's checkpoint (--checkpoint), which is "
                           f"exported with its adapters")
        name = d.adapter
        await session.fleet.for_each(lambda c: c.load_lora_adapter(name, str(adapter)))
        session.ctx.adapters[name].name = name


class Evals:
    """Evaluation during training (`rlx.rollout.evaluator`): at step 0, and after every ``eval.interval``
    steps as a task beside the next step's rollout (sync) or the rollout stream (async), on the weights of
    the step it evaluates: the next weight push (or engine offload) waits for it. Results go to the loggers
    at the step evaluated, to ``eval.jsonl`` and to the terminal."""

    def __init__(self, cfg: Config, plugins: Plugins, session: RolloutSession, loggers: list[Any], out: Path):
        from rlx.rollout.evaluator import Evaluator

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
        from rlx.rollout.evaluator import write_rows

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
