"""LoRA against full-parameter training, side by side: GRPO on the quickstart (`examples/quickstart.yaml`) training
every weight, and training LoRA adapters only (`examples/lora.yaml`, ``train.lora``), the engine serving the adapters
pushed alone (``push: adapter``, the default) or the merged weights (``push: merged``), over several seeds.

    scripts/loopback .venv/bin/python benchmarks/lora.py                   # seeds 1 2 3, 60 steps each
    scripts/loopback .venv/bin/python benchmarks/lora.py --seeds 1 --steps 20 --rank 8 --lora-lr 1e-3
    scripts/loopback .venv/bin/python benchmarks/lora.py --multi           # multi-LoRA beside one run per adapter

Printed per run: held-out greedy pass@1 (40 prompts none of the runs trains on) at the first and last evaluation,
the mean reward over the last 10 steps, the parameters the optimizer trains (``lora/params``), the bytes of
a push (``weight_sync/bytes``), seconds per push and per step; then each mode's means over seeds. LoRA's learning rate is its own (adapters start at zero; peft's and TRL's LoRA
examples take several times the full model's): 5e-4 here, where 1e-3 and 2e-3 generalised worse (RESULTS.md). The peers that train LoRA with RL (verl, miles, prime-rl)
run on GPUs; TRL's GRPOTrainer with peft runs on CPUs, and `benchmarks/vs_trl.py` is where rlx meets it.

``--multi``: multi-LoRA (`examples/multi_lora.yaml`: adapters ``add`` and ``sub``, each on its half of the task, trained
together in one run) beside one LoRA run per adapter on the same prompts (four of its task a step, as the multi-LoRA
run draws for each): per adapter, greedy pass@1 on its own held-out prompts at the start and the end, and the
wall-clock seconds of the runs (miles and prime-rl, which train several adapters at once, run on GPUs only).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _examples import example, rows, train


def run(folder: Path, seed: int, mode: str, lora: dict | None, lr: float, steps: int) -> dict[str, float]:
    name = f"{mode}-seed{seed}"
    doc = example(folder, name, "lora.yaml" if lora else "quickstart.yaml", steps=steps, seed=seed)
    doc["train"]["optim"]["lr"] = lr
    if lora:
        doc["train"]["lora"] = {**lora, "push": "merged" if mode == "lora-merged" else "adapter"}
    else:
        doc["train"].pop("lora", None)
    train(folder, name, doc)
    steps_ = [x for x in rows(folder, name) if "grad_norm" in x]
    evals = [x["pass@1"] for x in rows(folder, name, "eval.jsonl") if x["dataset"] == "heldout"]
    return {"pass@1 first": evals[0], "pass@1 last": evals[-1],
            "reward last 10": statistics.mean(x["reward/mean"] for x in steps_[-10:]),
            "trained params": steps_[0].get("lora/params", float("nan")),
            "push bytes": statistics.mean(x["weight_sync/bytes"] for x in steps_),
            "s/push": statistics.median(x["time/weight_sync_s"] for x in steps_[1:]),
            "s/step": statistics.median(x["time/step_s"] for x in steps_[1:])}


def multi(seeds: list[int], steps: int) -> None:
    """Multi-LoRA beside one LoRA run per adapter, on the same prompts per adapter and step."""
    print(f"multi-LoRA (examples/multi_lora.yaml), {steps} steps, seeds {seeds}")
    print("| seed | training | adapter | pass@1 first | pass@1 last | run seconds |")
    print("|---|---|---|---|---|---|")
    last: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            name = f"multi-seed{seed}"
            doc = example(Path(tmp), name, "multi_lora.yaml", steps=steps, seed=seed, evals=("add", "sub"))
            t0 = time.monotonic()
            train(Path(tmp), name, doc)
            took = time.monotonic() - t0
            evals = rows(Path(tmp), name, "eval.jsonl")
            for adapter in ("add", "sub"):
                scores = [x["pass@1"] for x in evals if x["dataset"] == adapter]
                last.setdefault(("two adapters, one run", adapter), []).append(scores[-1])
                print(f"| {seed} | two adapters, one run | {adapter} | {scores[0]:.3f} | {scores[-1]:.3f} | "
                      f"{took:.0f} (both) |")
            for a in doc["train"]["lora"]["adapters"]:  # the same adapter alone, on its half of the task
                one = f"alone-{a['name']}-seed{seed}"
                lora = {k: v for k, v in doc["train"]["lora"].items() if k != "adapters"}
                alone = {**doc, "data": {**doc["data"], "path": a["data"]["path"]},
                         "rollout": {**doc["rollout"], "n_prompts": doc["rollout"]["n_prompts"] // 2},
                         "train": {**doc["train"], "lora": lora},
                         "eval": {**doc["eval"], "datasets": [{k: v for k, v in d.items() if k != "adapter"}
                                                              for d in doc["eval"]["datasets"] if d["name"] == a["name"]]},
                         "run": {**doc["run"], "output_dir": str(Path(tmp) / one)}}
                t0 = time.monotonic()
                train(Path(tmp), one, alone)
                took = time.monotonic() - t0
                scores = [x["pass@1"] for x in rows(Path(tmp), one, "eval.jsonl")]
                last.setdefault(("its own run", a["name"]), []).append(scores[-1])
                print(f"| {seed} | its own run | {a['name']} | {scores[0]:.3f} | {scores[-1]:.3f} | {took:.0f} |")
    for (mode, adapter), v in last.items():
        print(f"| mean | {mode} | {adapter} | | {statistics.mean(v):.3f} | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--full-lr", type=float, default=1e-4)  # the quickstart's
    ap.add_argument("--lora-lr", type=float, default=5e-4)
    ap.add_argument("--multi", action="store_true", help="multi-LoRA beside one run per adapter")
    args = ap.parse_args()
    if args.multi:
        multi(args.seeds, args.steps)
        return
    lora = {"rank": args.rank, "alpha": args.alpha}
    table: dict[str, list[dict[str, float]]] = {"full": [], "lora": [], "lora-merged": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            table["full"].append(run(Path(tmp), seed, "full", None, args.full_lr, args.steps))
            for mode in ("lora", "lora-merged"):
                table[mode].append(run(Path(tmp), seed, mode, lora, args.lora_lr, args.steps))
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
    if key == "s/push":
        return f"{v:.4f}"
    if key == "trained params":
        return "all" if v != v else f"{v:,.0f}"
    return f"{v:.3f}"


if __name__ == "__main__":
    main()
