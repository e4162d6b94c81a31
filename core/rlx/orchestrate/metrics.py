"""Per-step metrics: ``metrics.jsonl`` (one object per step), the trained sample ids, plots, and the warnings
and notes a run prints about them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlx.plugins import Plugins
    from rlx.config import Config

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


def _wall(rows: list[dict[str, Any]]) -> list[float]:
    out, t = [], 0.0
    for r in rows:
        t += r.get("time/step_s") or 0.0
        out.append(t)
    return out


def _per_second(r: dict[str, Any]) -> float | None:
    return r["tokens"] / r["time/step_s"] if r.get("tokens") and r.get("time/step_s") else None


#: The panels of `rl plot`: (title, x axis, y of a row or None where the run did not log it, log scale).
PANELS: list[tuple[str, str, Any, bool]] = [
    ("mean reward", "step", lambda r: r.get("reward/mean"), False),
    ("mean reward by time", "wall", lambda r: r.get("reward/mean"), False),
    ("KL to the reference", "step", lambda r: r.get("kl"), False),
    ("entropy", "step", lambda r: r.get("entropy"), False),
    ("response length", "step", lambda r: r.get("response_len/mean"), False),
    ("trainer vs engine log-prob diff", "step", lambda r: r.get("train_rollout_logprob_diff") or None, True),
    ("throughput (tokens/s)", "step", _per_second, False),
    ("seconds per step", "step", None, False),  # the time split, drawn below
    ("eval pass@1 (held-out)", "step", "eval", False),  # a line per eval dataset, from eval.jsonl
]


def read_eval(run_dir: Path) -> list[dict[str, Any]]:
    """The run's evaluations during training (``eval.jsonl`` rows without a ``checkpoint``, which `rl eval`
    adds); none if it did not evaluate."""
    path = Path(run_dir) / "eval.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "checkpoint" not in r]


def plot(run_dirs: list[Path], out: Path) -> Path:
    """Training curves of one or more runs, overlaid: reward (by step and by time), KL, entropy, response
    length, trainer-vs-engine log-prob difference, throughput, the time split of a step and held-out
    evaluation (pass@1 per eval dataset), as a PNG.
    A run that did not log a metric (KL without a reference model) leaves that panel out for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(18, 13))
    for run in run_dirs:
        rows = read(run)
        label = Path(run).name
        steps, wall = [r["step"] for r in rows], _wall(rows)
        for ax, (title, x, y, _) in zip(axes.flat, PANELS, strict=True):
            if y == "eval":
                evals = read_eval(run)
                for name in dict.fromkeys(r["dataset"] for r in evals):
                    points = [(r["step"], r["pass@1"]) for r in evals if r["dataset"] == name]
                    ax.plot(*zip(*points, strict=True), marker="o", label=f"{label} {name}")
                continue
            if y is None:
                for key, style in (("time/rollout_s", "-"), ("time/train_s", "--"), ("time/weight_sync_s", ":")):
                    ax.plot(steps, [r.get(key) or 0.0 for r in rows], style, label=f"{label} {key[5:-2]}")
                continue
            points = [(xv, y(r)) for xv, r in zip(wall if x == "wall" else steps, rows, strict=True)
                      if y(r) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), label=label)
    for ax, (title, x, _, log) in zip(axes.flat, PANELS, strict=True):
        ax.set(title=title, xlabel="seconds (sum of step times)" if x == "wall" else "step")
        if log and ax.lines:
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


class DiffWatch:
    """Warns when the trainer-vs-engine log-prob difference jumps: a sign that the engines serve other
    weights than the trainer holds, sample at another temperature, or that numerics broke."""

    def __init__(self, factor: float = 5.0, floor: float = 0.02, window: int = 10):
        self.factor, self.floor, self.window = factor, floor, window
        self.seen: list[float] = []

    def see(self, step: int, diff: float | None) -> str | None:
        if diff is None:
            return None
        history = sorted(self.seen[-self.window:])
        self.seen.append(diff)
        if not history:
            return None
        median = history[len(history) // 2]
        if diff > self.floor and diff > self.factor * median:
            return (f"step {step}: train_rollout_logprob_diff jumped to {diff:.3g} (median of the last "
                    f"{len(history)} steps {median:.3g})")
        return None


def objective_notes(cfg: Config, plugins: Plugins) -> list[str]:
    """What a user should know about the objective they configured, before it runs."""
    obj, sampling = cfg.train.objective, cfg.rollout.sampling
    notes = []
    own = getattr(plugins.get("losses", obj.loss.name), "default_norm", None)  # only losses whose paper says
    if own is not None and obj.loss_norm is not None and obj.loss_norm != own:
        notes.append(f"train.objective.loss_norm: {obj.loss_norm} with the {obj.loss.name!r} loss, whose paper "
                     f"averages per {own}: the objective is not the paper's")
    if obj.tis_cap is not None and (sampling.top_p < 1 or sampling.top_k > 0 or sampling.min_p > 0):
        notes.append("rollout.sampling truncates the distribution (top_p/top_k/min_p); engines report log-probs of "
                     "the untruncated one, so importance correction is not exact for the tokens sampled "
                     "(agent requests that set their own top_p are not exact either)")
    return notes
