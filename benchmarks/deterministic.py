"""What run.deterministic costs, and that it repeats: the quickstart with and without it, side by side.

    scripts/loopback .venv/bin/python benchmarks/deterministic.py             # 20 steps each
    scripts/loopback .venv/bin/python benchmarks/deterministic.py --steps 60

`rl train examples/quickstart.yaml` (no evaluation, no checkpoints) three times: without ``run.deterministic``, and
twice with it. Printed per run: the median seconds per step and of its rollout and train phases, the mean reward, and
for the second deterministic run whether its metrics (wall-clock fields aside) equal the first's bit for bit. The
peer, slime's deterministic mode (SGLang's deterministic inference and Megatron's deterministic options), needs a GPU
attention backend and does not run on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]
WALL_CLOCK = ("time/", "cores/")


def run(folder: Path, name: str, deterministic: bool, steps: int) -> list[dict]:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["run"].update(output_dir=str(folder / name), loggers=[], deterministic=deterministic)
    doc["data"]["path"] = str(ROOT / "examples" / doc["data"]["path"])
    doc.pop("eval", None)
    doc["train"].update(num_steps=steps, checkpoint={"interval": 0})
    cfg = folder / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
    return [json.loads(x) for x in (folder / name / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run(Path(tmp), name, det, args.steps)
                for name, det in (("default", False), ("deterministic", True), ("deterministic again", True))}
    same = [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in runs["deterministic"]] == \
           [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in runs["deterministic again"]]
    print(f"examples/quickstart.yaml, {args.steps} steps, no evaluation")
    print(f"{'run':>20} {'s/step':>7} {'rollout s':>10} {'train s':>8} {'reward':>7}  repeats the first")
    for name, rows in runs.items():
        med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        reward = sum(r["reward/mean"] for r in rows) / len(rows)
        note = ("yes, bit for bit" if same else "NO") if name == "deterministic again" else ""
        print(f"{name:>20} {med('time/step_s'):>7.2f} {med('time/rollout_s'):>10.2f} {med('time/train_s'):>8.2f} "
              f"{reward:>7.3f}  {note}")


if __name__ == "__main__":
    main()
