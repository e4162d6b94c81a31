"""On-policy distillation against GRPO on the task reward, side by side on the quickstart's task: GRPO with the
exact-answer reward (`examples/quickstart.yaml`), distillation alone from a teacher (`examples/distill.yaml`), and the
two together; then the teacher itself on the same held-out prompts.

    scripts/loopback .venv/bin/python benchmarks/distill.py                  # seeds 1 2, 60 steps each
    scripts/loopback .venv/bin/python benchmarks/distill.py --seeds 1 --steps 20 --modes distill

The student is builtin://tiny-qwen3-arith, the teacher builtin://tiny-qwen3-arith-teacher (the same tiny model
trained ten times as long on the training prompts' answers). Printed per run: held-out greedy pass@1 (40 prompts
none of the runs trains on) at the first and last evaluation, the mean reward over the last 10 steps where there is a
reward, the per-token reverse KL to the teacher (`distill/reverse_kl`: the sampler's log-prob minus the teacher's,
over sampled tokens) over the first and last 10 steps where a teacher scores, and seconds per step; then each mode's
means over seeds. The peers that ship on-policy distillation (slime, verl, NeMo RL) need GPUs and SGLang/vLLM
teachers and do not run on this machine; GRPO on the same task is the baseline here.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from _examples import example, rows, train

MODES = ("grpo", "distill", "grpo+distill")


def config(folder: Path, name: str, mode: str, seed: int, steps: int) -> dict:
    doc = example(folder, name, "quickstart.yaml" if mode == "grpo" else "distill.yaml", steps=steps, seed=seed)
    if mode == "grpo+distill":
        doc["rollout"]["rewards"] = ["exact_match"]
    return doc


def run(folder: Path, mode: str, seed: int, steps: int) -> dict[str, float | None]:
    name = f"{mode}-seed{seed}"
    train(folder, name, config(folder, name, mode, seed, steps))
    metrics = [r for r in rows(folder, name) if "grad_norm" in r]
    evals = [r["pass@1"] for r in rows(folder, name, "eval.jsonl") if r["dataset"] == "heldout"]
    kl = [r["distill/reverse_kl"] for r in metrics if "distill/reverse_kl" in r]
    return {"pass@1 first": evals[0], "pass@1 last": evals[-1],
            "reward last 10": statistics.mean(r["reward/mean"] for r in metrics[-10:]) if mode != "distill" else None,
            "KL first 10": statistics.mean(kl[:10]) if kl else None,
            "KL last 10": statistics.mean(kl[-10:]) if kl else None,
            "s/step": statistics.median(r["time/step_s"] for r in metrics[1:])}


def teacher(folder: Path) -> float:
    """The teacher's held-out greedy pass@1 (`rl eval` with it as the model)."""
    cfg = folder / "teacher.yaml"
    cfg.write_text(yaml.safe_dump(config(folder, "teacher", "distill", 1, 1), sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "eval", str(cfg), "--set",
                        "model.path=builtin://tiny-qwen3-arith-teacher", "--set", "rollout.teachers=[]", "--set",
                        "train.objective.distill=null"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"rl eval of the teacher failed:\n{r.stderr[-3000:]}")
    return [r["pass@1"] for r in rows(folder, "teacher", "eval.jsonl") if r["dataset"] == "heldout"][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    table: dict[str, list[dict[str, float | None]]] = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mode in args.modes:
                table[mode].append(run(Path(tmp), mode, seed, args.steps))
        best = teacher(Path(tmp))
    keys = list(table[args.modes[0]][0])
    print(f"quickstart task, student builtin://tiny-qwen3-arith, {args.steps} steps, seeds {args.seeds}")
    print("| run | seed | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for mode in args.modes:
        for seed, s in zip(args.seeds, table[mode], strict=True):
            print(f"| {mode} | {seed} | " + " | ".join(_fmt(s[k]) for k in keys) + " |")
    for mode in args.modes:
        means = {k: (statistics.mean(v for s in table[mode] if (v := s[k]) is not None)
                     if table[mode][0][k] is not None else None) for k in keys}
        print(f"| {mode} | mean | " + " | ".join(_fmt(means[k]) for k in keys) + " |")
    print(f"teacher builtin://tiny-qwen3-arith-teacher: held-out pass@1 {best:.3f}")


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    main()
