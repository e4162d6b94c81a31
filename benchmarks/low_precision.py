"""Low-precision rollout against full precision, side by side: the quickstart with ``rollout.quantization`` off,
``fp8``, ``int4``, and ``int4`` with quantisation-aware training (``train.qat: int4``), over several seeds.

    scripts/loopback .venv/bin/python benchmarks/low_precision.py                   # seeds 1 2 3, 60 steps each
    scripts/loopback .venv/bin/python benchmarks/low_precision.py --seeds 1 --steps 20 --modes full int4 int4+qat

`rl train examples/quickstart.yaml` (checkpoints off) per seed and mode. With ``fp8`` the engine serves block-quantised
FP8 weights (e4m3, 128x128 scales; the embedded engine computes with them dequantised), with ``int4`` weight-only INT4
(groups of 128), and every push is quantised on the trainer's side; with QAT the trainer's forward computes with the
INT4 weights too. Printed per run: held-out greedy pass@1 at the first and last evaluation (40 prompts, served
by the run's own engine, so in FP8 for the FP8 runs), the mean reward over the last 10 steps, the mean |trainer -
engine| log-prob over sampled tokens (``train_rollout_logprob_diff``), the bytes of a push (``weight_sync/bytes``)
and seconds per step; then each mode's means over seeds. The peer, slime's FP8 and INT4 rollout (SGLang serving
quantised checkpoints), needs a GPU and does not run on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _examples import example, rows, train

MODES = (None, "fp8", "int4", "int4+qat")


def run(folder: Path, seed: int, mode: str | None, steps: int) -> tuple[list[dict], list[dict]]:
    """The run's metrics rows and its held-out greedy evaluations (``eval.jsonl``), in order."""
    name = f"{mode or 'full'}-seed{seed}"
    doc = example(folder, name, "quickstart.yaml", steps=steps, seed=seed, evals=("heldout", "heldout_sampled"))
    if mode is not None:
        doc["rollout"]["quantization"] = mode.removesuffix("+qat")
    if mode == "int4+qat":
        doc["train"]["qat"] = "int4"
    train(folder, name, doc)
    return rows(folder, name), [r for r in rows(folder, name, "eval.jsonl") if r["dataset"] == "heldout"]


def summary(run: tuple[list[dict], list[dict]]) -> dict[str, float]:
    rows, heldout = run
    evals = [r["pass@1"] for r in heldout]
    steps = [r for r in rows if "train_rollout_logprob_diff" in r]
    return {"pass@1 first": evals[0], "pass@1 last": evals[-1],
            "reward last 10": statistics.mean(r["reward/mean"] for r in steps[-10:]),
            "logprob diff": statistics.mean(r["train_rollout_logprob_diff"] for r in steps),
            "push bytes": statistics.mean(r["weight_sync/bytes"] for r in steps),
            "s/step": statistics.median(r["time/step_s"] for r in steps[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--modes", nargs="+", default=[m or "full" for m in MODES], choices=[m or "full" for m in MODES])
    args = ap.parse_args()
    modes = [None if m == "full" else m for m in args.modes]
    table: dict[str | None, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mode in modes:
                table[mode].append(summary(run(Path(tmp), seed, mode, args.steps)))
    keys = list(table[modes[0]][0])
    print(f"quickstart, {args.steps} steps, seeds {args.seeds}")
    print("| rollout | seed | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for mode in modes:
        for seed, s in zip(args.seeds, table[mode], strict=True):
            print(f"| {mode or 'full precision'} | {seed} | " + " | ".join(_fmt(k, s[k]) for k in keys) + " |")
    for mode in modes:
        means = {k: statistics.mean(s[k] for s in table[mode]) for k in keys}
        print(f"| {mode or 'full precision'} | mean | " + " | ".join(_fmt(k, means[k]) for k in keys) + " |")


def _fmt(key: str, v: float) -> str:
    if key == "push bytes":
        return f"{v / 1024:.0f} KiB"
    if key == "logprob diff":
        return f"{v:.1e}"
    return f"{v:.3f}"


if __name__ == "__main__":
    main()
