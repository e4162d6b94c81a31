"""How long `rl train` takes around its steps: start (Ray head, placement, trainer ranks, engines) and stop, on a
small run with Ray, against the steps themselves. Every integration test that runs `rl train` pays this, and so
does a user's first look at a config.

    scripts/loopback .venv/bin/python benchmarks/startup.py [--runs 3] [--steps 6]

Prints per run: wall time of the `rl` process, the steps' own time (metrics.jsonl ``time/step_s``), and the rest
(start-up and shutdown), then medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "core"))


def one(folder: Path, steps: int) -> tuple[float, float]:
    from rlx.testing.runs import small_run_config

    cfg = small_run_config(folder, "run", seed=7, rollout={"n_prompts": 3, "sampling": {"max_new_tokens": 4}},
                           train={"num_steps": steps})
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], capture_output=True, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"rl train failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    return wall, sum(row["time/step_s"] for row in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    walls, rests = [], []
    print(f"rl train, tiny model, {args.steps} steps, Ray on (one trainer rank, one embedded engine)")
    print(f"{'run':>4} {'wall s':>8} {'steps s':>8} {'start+stop s':>13}")
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            wall, steps = one(Path(tmp), args.steps)
        walls.append(wall)
        rests.append(wall - steps)
        print(f"{i + 1:>4} {wall:>8.2f} {steps:>8.2f} {wall - steps:>13.2f}", flush=True)
    print(f"median wall {statistics.median(walls):.2f} s, start+stop {statistics.median(rests):.2f} s")


if __name__ == "__main__":
    main()
