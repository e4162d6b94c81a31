"""Rollout routing replay (R3) on and off, side by side, on the tiny Qwen3-MoE.

    scripts/loopback .venv/bin/python benchmarks/routing_replay.py            # 15 steps each
    scripts/loopback .venv/bin/python benchmarks/routing_replay.py --steps 30 --engine-dtype float32

`rl train examples/qwen3-moe.yaml` twice with the engine reporting the experts it routed each token to
(``rollout.routed_experts``): once with ``train.objective.routing_replay: false`` and once ``true``. The engine
serves in bf16 (``--engine-dtype``) while the trainer is fp32, the kind of precision gap that makes a GPU engine
and its trainer route some tokens differently. Printed per run, as means over the steps: the fraction of
(token, layer) pairs whose experts the trainer used were the engine's (``moe/routing_agreement``), the fraction its
router would have picked by itself (``moe/natural_agreement``), the mean |trainer - engine| log-prob over sampled
tokens (``train_rollout_logprob_diff``), the reward over the last 5 steps, and seconds per step.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _examples import example, rows, train



def run(folder: Path, replay: bool, steps: int, engine_dtype: str) -> list[dict]:
    name = "r3-on" if replay else "r3-off"
    doc = example(folder, name, "qwen3-moe.yaml", steps=steps, evals=None)
    doc["rollout"]["routed_experts"] = True
    doc["rollout"]["engines"][0].setdefault("server_args", {})["dtype"] = engine_dtype
    doc["train"]["objective"]["routing_replay"] = replay
    train(folder, name, doc)
    return rows(folder, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for replay in (False, True):
            m = run(Path(tmp), replay, args.steps, args.engine_dtype)

            def mean(key: str, rows: list[dict] = m) -> float:
                vals = [r[key] for r in rows if key in r]
                return sum(vals) / len(vals) if vals else float("nan")

            rows.append(("on" if replay else "off", mean("moe/routing_agreement"), mean("moe/natural_agreement"),
                         mean("train_rollout_logprob_diff"), mean("reward/mean", m[-5:]), mean("time/step_s")))
    print(f"tiny Qwen3-MoE, {args.steps} steps, engine {args.engine_dtype}, trainer float32")
    print(f"{'R3':>4} {'routing agreement':>18} {'natural agreement':>18} {'logprob diff':>13} {'reward last 5':>14} "
          f"{'s/step':>7}")
    for name, used, natural, diff, reward, step in rows:
        print(f"{name:>4} {used:>18.4f} {natural:>18.4f} {diff:>13.2e} {reward:>14.3f} {step:>7.2f}")


if __name__ == "__main__":
    main()
