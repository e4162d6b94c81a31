"""Checkpoints that resume exactly: trainer (model, optimizer, scheduler, RNG), rollout (dataset
cursor, id counters, unfinished groups), step and weight version.

Written to ``<output_dir>/checkpoints/step_<N>`` through a temporary folder and a rename, so a run
killed while saving leaves the previous checkpoint intact; ``latest`` names the newest.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from rlx.errors import RLXError


def save(root: Path, step: int, trainer: Any, rollout_state: dict[str, Any],
         meta: dict[str, Any], keep: int = 2) -> Path:
    """`trainer` has ``save(folder)``; it writes its own files into the new checkpoint folder."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    trainer.save(tmp)
    (tmp / "rollout.json").write_text(json.dumps(rollout_state))
    (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    latest = root / "latest"
    (root / ".latest.tmp").write_text(final.name)
    os.replace(root / ".latest.tmp", latest)
    steps = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest(root: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(folder for the trainer's ``load``, rollout state, meta) of the newest checkpoint under `root`."""
    latest = root / "latest"
    if not latest.exists():
        raise RLXError(f"--resume: no checkpoint under {root} (nothing was saved yet; run without --resume)")
    folder = root / latest.read_text().strip()
    try:
        rollout = json.loads((folder / "rollout.json").read_text())
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError, RuntimeError) as e:
        raise RLXError(f"--resume: checkpoint {folder} is unreadable: {e}") from e
    return folder, rollout, meta
