"""Per-step metrics: ``metrics.jsonl`` (one object per step), the trained sample ids, and plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

REQUIRED = ("step", "reward/mean", "response_len/mean", "loss", "kl", "entropy", "time/rollout_s",
            "time/train_s", "time/weight_sync_s", "time/step_s", "samples", "tokens")


class MetricsLog:
    def __init__(self, output_dir: Path, resume_step: int | None = None):
        self.path = output_dir / "metrics.jsonl"
        self.samples_path = output_dir / "samples.jsonl"
        output_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            for p in (self.path, self.samples_path):
                p.unlink(missing_ok=True)
        else:  # drop what a killed run logged after its last checkpoint
            for p in (self.path, self.samples_path):
                if p.exists():
                    keep = [line for line in p.read_text().splitlines()
                            if line.strip() and json.loads(line)["step"] <= resume_step]
                    p.write_text("".join(line + "\n" for line in keep))

    def write(self, record: dict[str, Any], sample_ids: list[int]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        with open(self.samples_path, "a") as f:
            f.write(json.dumps({"step": record["step"], "sample_ids": sample_ids}) + "\n")


def read(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        from rlx.errors import RLXError

        raise RLXError(f"{run_dir}: no metrics.jsonl (is this a run's output_dir?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(run_dirs: list[Path], out: Path) -> Path:
    """Reward and timing curves of one or more runs, side by side, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_w, ax_t) = plt.subplots(1, 3, figsize=(17, 4.5))
    for run in run_dirs:
        rows = read(run)
        steps = [r["step"] for r in rows]
        label = Path(run).name
        rewards = [r["reward/mean"] for r in rows]
        ax_r.plot(steps, rewards, label=label)
        wall, t = [], 0.0
        for r in rows:
            t += r.get("time/step_s") or 0.0
            wall.append(t)
        ax_w.plot(wall, rewards, label=label)
        for key, style in (("time/rollout_s", "-"), ("time/train_s", "--"), ("time/weight_sync_s", ":")):
            ax_t.plot(steps, [r.get(key) or 0.0 for r in rows], style, label=f"{label} {key[5:-2]}")
    ax_r.set(title="mean reward", xlabel="step")
    ax_w.set(title="mean reward", xlabel="seconds (sum of step times)")
    ax_w.legend()
    ax_t.set(title="seconds per step", xlabel="step")
    ax_r.legend()
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
