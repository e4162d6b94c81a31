"""LoRA against full-parameter training, side by side: GRPO on the quickstart (`examples/quickstart.yaml`) training
every weight, and training LoRA adapters only (``train.lora``), over several seeds.

    scripts/loopback .venv/bin/python benchmarks/lora.py                   # seeds 1 2 3, 60 steps each
    scripts/loopback .venv/bin/python benchmarks/lora.py --seeds 1 --steps 20 --rank 8 --lora-lr 2e-3

Printed per run: held-out greedy pass@1 (40 prompts none of the runs trains on) at the first and last evaluation,
the mean reward over the last 10 steps, the parameters the optimizer trains (from the run's log line), the bytes of
a push (``weight_sync/bytes``: LoRA pushes the merged weights for now, so the same as full) and seconds per step;
then each mode's means over seeds. LoRA's learning rate is its own (adapters start at zero and take larger steps;
peft's and TRL's LoRA examples use 10x the full model's). The peers that train LoRA with RL (verl, miles, prime-rl)
run on GPUs; TRL's GRPOTrainer with peft runs on CPUs, and `benchmarks/vs_trl.py` is where rlx meets it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]


def run(folder: Path, seed: int, lora: dict | None, lr: float, steps: int) -> dict[str, float]:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    name = f"{'lora' if lora else 'full'}-seed{seed}"
    doc["run"].update(output_dir=str(folder / name), loggers=[], seed=seed)
    doc["data"]["path"] = str(ROOT / "examples" / doc["data"]["path"])
    doc["eval"]["datasets"] = [d for d in doc["eval"]["datasets"] if d["name"] == "heldout"]
    for d in doc["eval"]["datasets"]:
        d["path"] = str(ROOT / "examples" / d["path"])
    doc["eval"]["interval"] = steps
    doc["train"].update(num_steps=steps, checkpoint={"interval": 0})
    doc["train"]["optim"]["lr"] = lr
    if lora:
        doc["train"]["lora"] = lora
    cfg = folder / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (folder / name / "metrics.jsonl").read_text().splitlines()]
    steps_ = [x for x in rows if "grad_norm" in x]
    evals = [x["pass@1"] for x in map(json.loads, (folder / name / "eval.jsonl").read_text().splitlines())
             if x["dataset"] == "heldout"]
    trained = re.search(r"rlx: LoRA on \d+ projections \([^)]*\): ([\d,]+) adapter parameters", r.stderr)
    return {"pass@1 first": evals[0], "pass@1 last": evals[-1],
            "reward last 10": statistics.mean(x["reward/mean"] for x in steps_[-10:]),
            "trained params": float(trained.group(1).replace(",", "")) if trained else float("nan"),
            "push bytes": statistics.mean(x["weight_sync/bytes"] for x in steps_),
            "s/step": statistics.median(x["time/step_s"] for x in steps_[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--full-lr", type=float, default=1e-4)  # the quickstart's
    ap.add_argument("--lora-lr", type=float, default=1e-3)
    args = ap.parse_args()
    lora = {"rank": args.rank, "alpha": args.alpha}
    table: dict[str, list[dict[str, float]]] = {"full": [], "lora": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            table["full"].append(run(Path(tmp), seed, None, args.full_lr, args.steps))
            table["lora"].append(run(Path(tmp), seed, lora, args.lora_lr, args.steps))
    keys = list(table["full"][0])
    print(f"quickstart, {args.steps} steps, seeds {args.seeds}; full lr {args.full_lr:g}; LoRA rank {args.rank}, "
          f"alpha {args.alpha:g}, lr {args.lora_lr:g}")
    print("| training | seed | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for mode, runs in table.items():
        for seed, s in zip(args.seeds, runs, strict=True):
            print(f"| {mode} | {seed} | " + " | ".join(_fmt(k, s[k]) for k in keys) + " |")
    for mode, runs in table.items():
        means = {k: statistics.mean(s[k] for s in runs) for k in keys}
        print(f"| {mode} | mean | " + " | ".join(_fmt(k, means[k]) for k in keys) + " |")


def _fmt(key: str, v: float) -> str:
    if key == "push bytes":
        return f"{v / 1024:.0f} KiB"
    if key == "trained params":
        return "all" if v != v else f"{v:,.0f}"
    return f"{v:.3f}"


if __name__ == "__main__":
    main()
