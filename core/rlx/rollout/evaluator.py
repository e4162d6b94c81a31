"""Evaluation on held-out prompts: each `eval.datasets` entry through the run's engines and generator, with
its own sampling, rewards and samples per prompt.

Metrics per dataset, under ``eval/<name>/``: ``reward_mean``; ``pass@1`` and ``pass@<n>`` (the unbiased
estimator of Chen et al. 2021, ``1 - C(n-c, k) / C(n, k)`` per prompt with c correct samples of n,
averaged over prompts; a sample is correct when its reward is at least ``correct_at``); ``response_len_mean``
(tokens); ``truncated_frac``; ``failed`` (samples whose generation or reward failed: scored 0, never
dropped); ``n_prompts``; and for agent generators ``turns_mean``. A sample cut by a weight swap or an
abort is resumed from what it has, so every prompt is answered.

Used by the training loop (`rlx.orchestrate.loop`, every ``eval.interval`` steps and at step 0) and by
``rl eval``, which also writes one row per dataset to ``<output_dir>/eval.jsonl``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.config import Config, EvalDatasetConfig
from rlx.data.datasets import PromptDataset, PromptRow, tokenize_prompt
from rlx.errors import RLXError
from rlx.rollout.context import GenerateContext, for_sample
from rlx.rollout.rewards import Rewards
from rlx.types import Sample, SampleStatus

if TYPE_CHECKING:
    from rlx.plugins import Plugins

MAX_RESUMES = 8  # a sample aborted this many times (by swaps or aborts) counts as failed


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, of which c are
    correct, is correct: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code")."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def dataset_metrics(spec: EvalDatasetConfig, groups: list[list[Sample]]) -> dict[str, float]:
    """The metrics of one dataset from its groups (the samples of each prompt)."""
    p = f"eval/{spec.name}/"
    samples = [s for g in groups for s in g]
    rewards = [s.reward if s.reward is not None and s.status.trainable else 0.0 for s in samples]
    out = {p + "n_prompts": float(len(groups)),
           p + "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
           p + "response_len_mean": (sum(len(s.response_ids) for s in samples) / len(samples)) if samples else 0.0,
           p + "truncated_frac": (sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples))
           if samples else 0.0,
           p + "failed": float(sum(not s.status.trainable for s in samples))}
    for k in sorted({1, spec.n_samples}):
        scores = []
        for g in groups:
            correct = sum(s.status.trainable and s.reward is not None and s.reward >= spec.correct_at for s in g)
            scores.append(pass_at_k(len(g), correct, min(k, len(g))) if g else 0.0)
        out[p + f"pass@{k}"] = sum(scores) / len(scores) if scores else 0.0
    turns = [s.metadata["agent_turns"] for s in samples if "agent_turns" in s.metadata]
    if turns:
        out[p + "turns_mean"] = sum(turns) / len(turns)
    return out


def adapter_rewards(cfg: Config, adapter: str | None) -> list[Any]:
    """The rewards an eval dataset of `adapter` (multi-LoRA) scores with when it lists none: the adapter's own, where it
    lists them, else ``rollout.rewards``."""
    own = next((a.rewards for a in (cfg.train.lora.adapters if cfg.train.lora else []) if a.name == adapter), None)
    return own if own is not None else cfg.rollout.rewards


class Evaluator:
    """Runs every eval dataset of the config through a generator context (the run's engines)."""

    def __init__(self, cfg: Config, plugins: Plugins, ctx: GenerateContext):
        self.cfg = cfg
        self.plugins = plugins
        self.ctx = ctx
        self.generator = plugins.build("generators", cfg.rollout.generator)
        self.datasets: list[tuple[EvalDatasetConfig, list[PromptRow], list[list[int]], Rewards]] = []
        for i, spec in enumerate(cfg.eval.datasets):
            try:
                rows = PromptDataset(cfg.data, Path(spec.path), cfg.run.seed).rows[: spec.max_prompts]
            except RLXError as e:
                raise RLXError(f"eval.datasets[{i}] ({spec.name}): {e}") from None
            if spec.adapter is not None and spec.adapter not in ctx.adapters:
                raise RLXError(f"eval.datasets[{i}] ({spec.name}): adapter {spec.adapter!r} is not one these engines "
                               f"serve (train.lora.adapters: {sorted(ctx.adapters) or 'none'})")
            ids = [tokenize_prompt(ctx.tokenizer, r, cfg.data.apply_chat_template) for r in rows]
            rewards = (Rewards(spec.rewards, plugins, cfg.rollout, f"eval.datasets[{i}].rewards")
                       if spec.rewards is not None else Rewards(adapter_rewards(cfg, spec.adapter), plugins, cfg.rollout))
            self.datasets.append((spec, rows, ids, rewards))
        self.sem = asyncio.Semaphore(cfg.rollout.requests.max_concurrency)

    def __bool__(self) -> bool:
        return bool(self.datasets)

    async def run(self) -> tuple[dict[str, float], dict[str, list[dict[str, Any]]]]:
        """Every dataset: (metrics of all of them, sample rows per dataset)."""
        metrics: dict[str, float] = {}
        rows: dict[str, list[dict[str, Any]]] = {}
        for spec, prompt_rows, ids, rewards in self.datasets:
            t0 = time.monotonic()
            ctx = dataclasses.replace(self.ctx, sampling=spec.effective_sampling(self.cfg.rollout.sampling))
            groups = await asyncio.gather(*(self._group(ctx, spec, rewards, i, row, prompt)
                                            for i, (row, prompt) in enumerate(zip(prompt_rows, ids, strict=True))))
            metrics.update(dataset_metrics(spec, groups))
            metrics[f"eval/{spec.name}/time_s"] = time.monotonic() - t0
            rows[spec.name] = [{"prompt": s.prompt_text, "response": s.response_text, "reward": s.reward,
                                "label": s.label, "status": s.status.value} for g in groups for s in g]
        return metrics, rows

    async def _group(self, ctx, spec, rewards, index, row, prompt) -> list[Sample]:
        samples = [Sample(prompt_ids=list(prompt), prompt_text=row.prompt or "", label=row.label, group_id=index,
                          sample_id=index * spec.n_samples + j, index=j, metadata=dict(row.metadata),
                          lora=spec.adapter)
                   for j in range(spec.n_samples)]
        out = await asyncio.gather(*(self._sample(ctx, s, rewards) for s in samples))
        return [s for branch in out for s in branch[-1:]]  # an agent's trajectory counts once, by its answer

    async def _sample(self, ctx, sample: Sample, rewards) -> list[Sample]:
        async with self.sem:
            for _ in range(MAX_RESUMES):
                try:
                    out = await self.generator.generate(for_sample(ctx, sample), sample)
                except Exception as e:  # an eval sample that fails counts as failed, it does not end the run
                    sample.status, sample.error = SampleStatus.FAILED, f"{type(e).__name__}: {e}"
                    return [sample]
                if len(out) == 1 and out[0].status == SampleStatus.ABORTED:
                    sample = out[0]
                    continue
                break
            else:
                sample.status, sample.error = SampleStatus.FAILED, f"aborted {MAX_RESUMES} times"
                return [sample]
        final = next((s for s in reversed(out) if s.metadata.get("final")), out[-1])
        if final.status.trainable and final.reward is None:
            await rewards.score(final)
        return [s for s in out if s is not final] + [final]


def write_rows(output_dir: Path, step: int, metrics: dict[str, float], samples: dict[str, list[dict]],
               checkpoint: str | None = None) -> Path:
    """Append one row per dataset to ``<output_dir>/eval.jsonl`` (step, dataset, its metrics without the
    prefix) and the samples to ``<output_dir>/eval_samples/step_<N>/<dataset>.jsonl``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "eval.jsonl"
    with open(path, "a", encoding="utf-8") as f:
        for name, rows in samples.items():
            prefix = f"eval/{name}/"
            row = {"step": step, "dataset": name, **({"checkpoint": checkpoint} if checkpoint else {}),
                   **{k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}}
            f.write(json.dumps(row) + "\n")
            folder = output_dir / "eval_samples" / f"step_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    return path


def table(metrics: dict[str, float], names: list[str]) -> str:
    """The metrics of each dataset as a text table, a row per dataset."""
    cols = sorted({k.split("/", 2)[2] for k in metrics if k.startswith("eval/")} - {"time_s"},
                  key=lambda c: (not c.startswith("pass@"), c != "reward_mean", c))
    width = max([len("dataset")] + [len(n) for n in names])
    lines = ["  ".join(["dataset".ljust(width)] + [c.rjust(max(len(c), 8)) for c in cols])]
    for n in names:
        cells = []
        for c in cols:
            v = metrics.get(f"eval/{n}/{c}")
            cells.append(("-" if v is None else f"{v:.4g}").rjust(max(len(c), 8)))
        lines.append("  ".join([n.ljust(width)] + cells))
    return "\n".join(lines)
