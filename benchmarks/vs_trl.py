"""One GRPO workload through rlx and through TRL's GRPOTrainer on CPU, side by side.

Same model (the built-in tiny Qwen3-shaped model), prompts (arithmetic), group size (8 completions per
prompt), prompts per step (8), token budget (16 new tokens), reward (fraction of digit characters),
learning rate, no KL term. Steady-state seconds per step and samples per second are the medians over the
timed steps, after warm-up steps that are not counted (start-up is excluded on both sides).

    scripts/loopback .venv/bin/python benchmarks/vs_trl.py [--steps 12] [--warmup 3]

Needs `pip install trl`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS, GROUP, TOKENS, LR = 8, 8, 16, 1e-3


def digits(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def run_rlx(data: Path, out: Path, steps: int) -> list[dict]:
    from rlx.config import parse_config
    from rlx.orchestrate.loop import train
    from rlx.orchestrate.metrics import read
    from rlx.plugins import build_plugins

    cfg = parse_config(json.dumps({
        "run": {"output_dir": str(out), "seed": 1},
        "model": {"path": "builtin://tiny-qwen3"},
        "data": {"path": str(data)},
        "rollout": {"n_prompts": PROMPTS, "n_samples_per_prompt": GROUP, "rewards": ["digits"],
                    "sampling": {"max_new_tokens": TOKENS, "temperature": 1.0},
                    "engines": [{"server_args": {"num_threads": 1}}]},
        "train": {"num_steps": steps, "optim": {"lr": LR}, "checkpoint": {"interval": 0}},
    }))
    asyncio.run(train(cfg, build_plugins()))
    return read(out)


def run_trl(data: Path, out: Path, steps: int) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlx.models.tiny import resolve_model_path

    path = resolve_model_path("builtin://tiny-qwen3")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])

    def reward(completions, **_):
        return [digits(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
                        max_completion_length=TOKENS, max_steps=steps, learning_rate=LR, beta=0.0,
                        temperature=1.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                        bf16=False, seed=1, lr_scheduler_type="constant", warmup_steps=0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=reward, args=config,
                          train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(path),
                          callbacks=[Clock()])
    trainer.train()
    return [{"time/step_s": stamps[i + 1] - stamps[i]} for i in range(0, len(stamps) - 1, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    from rlx.data.tasks import arithmetic, write_jsonl

    tmp = Path(tempfile.mkdtemp(prefix="rlx-vs-trl-"))
    data = write_jsonl(arithmetic(512), tmp / "data.jsonl")
    results, parts = {}, {}
    for name, fn in (("rlx", run_rlx), ("TRL GRPOTrainer", run_trl)):
        rows = fn(data, tmp / name.split()[0].lower(), args.steps)[args.warmup:]
        s = statistics.median(r["time/step_s"] for r in rows)
        results[name] = (s, PROMPTS * GROUP / s)
        parts[name] = {k[5:-2]: statistics.median(r[k] for r in rows) for k in rows[0]
                       if k.startswith("time/") and k != "time/step_s"}
    print(f"GRPO on CPU: tiny Qwen3, {PROMPTS} prompts x {GROUP} completions x {TOKENS} tokens per step, "
          f"median of {args.steps - args.warmup} steps after {args.warmup} warm-up")
    print(f"{'framework':<18} | {'s/step':>7} | {'samples/s':>9} | where the time goes")
    for name, (s, sps) in results.items():
        where = ", ".join(f"{k} {v:.3f}s" for k, v in parts[name].items()) or "(one loop)"
        print(f"{name:<18} | {s:>7.3f} | {sps:>9.1f} | {where}")
    r, t = results["rlx"][0], results["TRL GRPOTrainer"][0]
    print(f"rlx is {t / r:.2f}x TRL's speed per step")


if __name__ == "__main__":
    main()
