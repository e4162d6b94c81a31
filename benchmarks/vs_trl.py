"""One GRPO workload through rlx (sync; async with the cores shared, the default, and split: `cpu.async_cores`)
and through TRL's GRPOTrainer on CPU, side by side.

Same model, prompts (arithmetic), completions per prompt, prompts per step, new tokens, reward (fraction of
digit characters), learning rate, no KL term. Seconds per step, phase times and cores used are medians over
the timed steps, after warm-up steps that are not counted (start-up is excluded on both sides).

Workloads (``--model``):
- ``tiny``: the built-in tiny Qwen3-shaped model, 8 prompts x 8 completions x 16 tokens, lr 1e-3;
- ``smollm2``: SmolLM2-135M-Instruct, 4 prompts x 4 completions x 32 tokens, lr 1e-6.

    scripts/loopback .venv/bin/python benchmarks/vs_trl.py [--model tiny|smollm2] [--steps 12] [--warmup 3]

Rows: rlx sync, async and async split; TRL as its users run it (torch's CPU matmul, MKL); and TRL with the
``matmul`` kernel rlx chooses for the model installed in its process (auto: oneDNN where it pays,
`rlx.builtins.matmul`; the log says which), which shows how much of the difference is that kernel. rlx's
trainer and engines choose their kernel by ``model.kernels.matmul: auto`` (set here; torch's own is the default).

Needs `pip install trl`. Cores used: the CPU seconds of every process of the run (driver, trainer ranks,
engines; TRL: its one process) over the wall time of the phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Workload:
    model: str
    prompts: int
    group: int
    tokens: int
    lr: float
    steps: int
    warmup: int


WORKLOADS = {
    "tiny": Workload("builtin://tiny-qwen3", 8, 8, 16, 1e-3, 12, 3),
    "smollm2": Workload("builtin://smollm2-135m-instruct", 4, 4, 32, 1e-6, 4, 1),
}


def digits(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def run_rlx(w: Workload, data: Path, out: Path, mode: str, async_cores: str = "share") -> list[dict]:
    from rlx.config import parse_config
    from rlx.orchestrate.loop import train
    from rlx.orchestrate.metrics import read
    from rlx.plugins import build_plugins

    cfg = parse_config(json.dumps({
        "run": {"output_dir": str(out), "seed": 1},
        "model": {"path": w.model, "kernels": {"matmul": "auto"}},
        "data": {"path": str(data)},
        "rollout": {"n_prompts": w.prompts, "n_samples_per_prompt": w.group, "rewards": ["digits"],
                    "sampling": {"max_new_tokens": w.tokens, "temperature": 1.0}},
        "cpu": {"async_cores": async_cores},
        "train": {"mode": mode, "num_steps": w.steps, "optim": {"lr": w.lr},
                  "checkpoint": {"interval": 0}},
    }))
    asyncio.run(train(cfg, build_plugins()))
    return read(out)


def run_trl(w: Workload, data: Path, out: Path, matmul: str = "torch") -> list[dict]:
    """TRL in this process, with torch's own CPU matmul (MKL), as TRL users run it, or (``auto``) with the
    ``matmul`` kernel rlx's trainer and engines choose for this model on this CPU installed for the run."""
    import torch
    from transformers import AutoConfig

    from rlx.builtins.matmul import TorchMatmul
    from rlx.train.kernel_choice import install_matmul
    from rlx.models.tiny import resolve_model_path
    from rlx.plugins import build_plugins
    from rlx.train.kernel_choice import use_matmul

    hidden = AutoConfig.from_pretrained(resolve_model_path(w.model)).hidden_size
    use_matmul(build_plugins(), matmul, "cpu", torch.float32, hidden)
    try:
        return _run_trl(w, data, out)
    finally:
        install_matmul(TorchMatmul())


def _run_trl(w: Workload, data: Path, out: Path) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlx.models.tiny import resolve_model_path

    path = resolve_model_path(w.model)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])

    def reward(completions, **_):
        return [digits(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    steps: list[dict] = []
    rollout = [0.0]

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            rollout[0] = 0.0
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            wall = time.perf_counter() - self.t0
            steps.append({"time/step_s": wall, "time/rollout_s": rollout[0], "time/train_s": wall - rollout[0],
                          "cores/step": (time.process_time() - self.c0) / wall})

    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=w.prompts * w.group,
                        num_generations=w.group, max_completion_length=w.tokens, max_steps=w.steps,
                        learning_rate=w.lr, beta=0.0, temperature=1.0, logging_steps=1, report_to=[],
                        save_strategy="no", use_cpu=True, bf16=False, seed=1, lr_scheduler_type="constant",
                        warmup_steps=0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=reward, args=config,
                          train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(path),
                          callbacks=[Clock()])
    generate = trainer._generate_and_score_completions  # the rollout: generation and rewards

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            rollout[0] += time.perf_counter() - t

    trainer._generate_and_score_completions = timed
    trainer.train()
    return steps


def median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def rlx_cores(r: dict) -> float | None:
    """Cores used over a whole step: each phase's cores weighted by its time."""
    parts = [(r.get(f"cores/{p}"), r.get(f"time/{p}_s")) for p in ("rollout", "train", "weight_sync")]
    if any(c is None for c, _ in parts):
        return None
    return sum(c * t for c, t in parts) / sum(t for _, t in parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(WORKLOADS), default="tiny")
    ap.add_argument("--steps", type=int, help="steps per run (default: the workload's)")
    ap.add_argument("--warmup", type=int, help="first steps not timed (default: the workload's)")
    args = ap.parse_args()
    w = WORKLOADS[args.model]
    w.steps = args.steps or w.steps
    w.warmup = args.warmup if args.warmup is not None else w.warmup
    with tempfile.TemporaryDirectory(prefix="rlx-vs-trl-") as folder:  # runs write checkpoints: GBs for SmolLM2
        table = measure(w, Path(folder))
    print(f"GRPO on CPU: {w.model}, {w.prompts} prompts x {w.group} completions x {w.tokens} tokens per step, "
          f"lr {w.lr:g}; median of {w.steps - w.warmup} steps after {w.warmup} warm-up")

    def cell(v, fmt):
        return "—" if v is None else format(v, fmt)

    print(f"| {'framework':<16} | s/step | rollout | train | weight sync | cores: rollout / train / step | vs TRL |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    trl = table["TRL GRPOTrainer"]["time/step_s"]
    for name, m in table.items():
        cores = " / ".join(cell(m[k], ".2f") for k in ("cores/rollout", "cores/train", "cores/step"))
        print(f"| {name:<16} | {m['time/step_s']:.3f} | {cell(m['time/rollout_s'], '.3f')} | "
              f"{cell(m['time/train_s'], '.3f')} | {cell(m['time/weight_sync_s'], '.3f')} | {cores} | "
              f"{m['time/step_s'] / trl:.2f}x |")


def measure(w: Workload, tmp: Path) -> dict[str, dict[str, float | None]]:
    """Each framework's medians over the timed steps, runs in `tmp`."""
    from rlx.tasks import arithmetic, write_jsonl

    data = write_jsonl(arithmetic(512), tmp / "data.jsonl")
    runs = {"rlx sync": lambda: run_rlx(w, data, tmp / "rlx-sync", "sync"),
            "rlx async": lambda: run_rlx(w, data, tmp / "rlx-async", "async"),
            "rlx async split": lambda: run_rlx(w, data, tmp / "rlx-async-split", "async", "split"),
            "TRL GRPOTrainer": lambda: run_trl(w, data, tmp / "trl"),
            "TRL + rlx matmul": lambda: run_trl(w, data, tmp / "trl-rlx-matmul", "auto")}
    table = {}
    for name, fn in runs.items():
        rows = fn()[w.warmup:]
        for r in rows:
            r.setdefault("cores/step", rlx_cores(r))
        table[name] = {k: median(rows, k) for k in ("time/step_s", "time/rollout_s", "time/train_s",
                                                      "time/weight_sync_s", "cores/rollout", "cores/train",
                                                      "cores/step")}
    return table


if __name__ == "__main__":
    main()
