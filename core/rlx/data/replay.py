"""Training on saved batches (``rollout.source: replay``): what a run wrote with ``rollout.save_batches`` (one file a
step in its ``batches/``) or what `rl rollout` wrote, step by step, with no engine. A step's loss and update can so be
run again from the checkpoint before it, to bisect a step that went wrong; under ``run.deterministic`` a replay of a
step from that checkpoint repeats the original bit for bit.

Each line of a batch file is a whole group (`Group.to_dict`) with its ``step``. Step k trains on the groups saved for
step k, in the order saved; a step the files lack is an error naming the steps they hold.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rlx.config import Config
from rlx.errors import RLXError
from rlx.types import Group, RolloutBatch


def batch_records(batch: RolloutBatch) -> list[dict[str, Any]]:
    """One JSON object per group, whole, with its step: what `rl rollout` and ``rollout.save_batches`` write."""
    return [{"step": batch.step, **g.to_dict()} for g in batch.groups]


def save_batch(batch: RolloutBatch, folder: Path) -> Path:
    """Write `batch` to `folder`/step-<step>.jsonl, whole or not at all (a step run again after a resume replaces
    it)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{batch.step:06d}.jsonl"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(rec) + "\n" for rec in batch_records(batch)))
    os.replace(tmp, path)
    return path


def read_batches(path: Path) -> dict[int, list[Group]]:
    """The saved groups by step, from a batch file or a folder of them (``*.jsonl``)."""
    if not path.exists():
        raise RLXError(f"rollout.replay: {path} does not exist")
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    steps: dict[int, list[Group]] = {}
    for f in files:
        for line, text in enumerate(f.read_text().splitlines(), 1):
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
                steps.setdefault(int(rec["step"]), []).append(Group.from_dict(rec))
            except (ValueError, KeyError, TypeError) as e:
                raise RLXError(f"{f}:{line}: not a saved group ({type(e).__name__}: {e})") from None
    if not steps:
        raise RLXError(f"rollout.replay: {path} holds no saved batch")
    return steps


class ReplayBatches:
    """The loop's batch source for ``rollout.source: replay`` (`rlx.rollout.batches.BatchSource`)."""

    def __init__(self, cfg: Config):
        assert cfg.rollout.replay is not None
        self.path = Path(cfg.rollout.replay)
        self.steps = read_batches(self.path)

    def start(self) -> None:
        pass

    async def next_batch(self, step: int, version: int) -> RolloutBatch:
        t0 = time.monotonic()
        if step not in self.steps:
            held = sorted(self.steps)
            steps = f"{held[0]}-{held[-1]}" if held == list(range(held[0], held[-1] + 1)) else str(held)
            raise RLXError(f"rollout.replay: {self.path} has no batch for step {step}; it holds steps {steps}")
        batch = RolloutBatch(step, self.steps[step], version)
        batch.metrics.update({**batch.sample_metrics(), "time/rollout_s": time.monotonic() - t0})
        return batch

    async def before_train(self) -> None:
        pass

    async def after_train(self) -> None:
        pass

    async def swap(self, push: Any) -> None:
        await push()

    async def state_dict(self) -> dict[str, Any]:
        return {}  # the step says which batch comes next

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    async def rewind(self, state: dict[str, Any]) -> None:
        pass

    async def close(self) -> None:
        pass
