"""Checkpoints that resume exactly: trainer (model, optimizer, scheduler, RNG), rollout (dataset
cursor, id counters, unfinished groups), step and weight version.

A checkpoint is complete or absent: written to ``<output_dir>/checkpoints/.step_<N>.tmp``, every file
fsynced, marked last with a ``COMPLETE`` file, then renamed to ``step_<N>``. The newest complete one is found
by reading the folders themselves (``latest`` is written for people and tools, never trusted). Each run has
an id, kept across resumes: pruning keeps the newest ``keep`` checkpoints *of this run* and never touches
another run's left in the same folder, and ``--resume`` takes the most recently saved complete checkpoint.
A save that fails (a full disk says so, naming the filesystem and the path) leaves nothing behind, and the
leftovers of a save that was killed are removed by the next one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.errors import RLXError
from rlx.fsio import fsync_path, fsync_tree, write_synced

if TYPE_CHECKING:
    from rlx.orchestrate.ranks import TrainerGroup

MARKER = "COMPLETE"


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def save(root: Path, step: int, trainer: TrainerGroup, rollout_state: dict[str, Any],
         meta: dict[str, Any], keep: int = 2) -> Path:
    """`trainer` has ``save(folder)``; it writes its own files into the new checkpoint folder. `meta` should
    carry ``run_id`` (pruning keeps to that run's checkpoints)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step_*.tmp"):  # a save killed half way
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    body = {"step": step, "saved_at": time.time(), **meta}
    try:
        tmp.mkdir()
        trainer.save(tmp)
        (tmp / "rollout.json").write_text(json.dumps(rollout_state))
        (tmp / "meta.json").write_text(json.dumps(body))
        fsync_tree(tmp)
        write_synced(tmp / MARKER, json.dumps({"step": step, "run_id": meta.get("run_id")}).encode())
        fsync_path(tmp)
        if final.exists():  # the same step saved before (a run restarted in this folder): replaced whole
            gone = root / f".step_{step}.old-{uuid.uuid4().hex[:8]}.tmp"
            os.rename(final, gone)
            shutil.rmtree(gone, ignore_errors=True)
        os.rename(tmp, final)
        fsync_path(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _no_space(e, root):
            raise RLXError(f"no space left on {_filesystem(root)} writing checkpoint {tmp} "
                           f"({type(e).__name__}: {e}); the previous checkpoint is intact") from e
        raise
    (root / ".latest.tmp").write_text(final.name)
    os.replace(root / ".latest.tmp", root / "latest")
    mine = [(s, f) for s, f, m in complete(root) if m.get("run_id") == meta.get("run_id")]
    for _, old in sorted(mine)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete(root: Path) -> list[tuple[int, Path, dict[str, Any]]]:
    """(step, folder, meta) of every complete checkpoint under `root`, in no particular order."""
    out = []
    for folder in root.glob("step_*"):
        if not folder.name[5:].isdigit() or not (folder / MARKER).is_file():
            continue
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        out.append((int(folder.name[5:]), folder, meta))
    return out


def newest(root: Path) -> Path | None:
    """The most recently saved complete checkpoint under `root` (None if there is none)."""
    found = complete(root) if root.is_dir() else []
    return max(found, key=lambda x: (x[2].get("saved_at", 0.0), x[0]))[1] if found else None


def resume_folder(root: Path) -> Path:
    """The checkpoint ``--resume`` takes: the newest complete one under `root`, or a clear error."""
    folder = newest(root)
    if folder is None:
        raise RLXError(f"--resume: no complete checkpoint under {root} (nothing was saved yet; run without "
                       f"--resume)")
    return folder


def load_latest(root: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(folder for the trainer's ``load``, rollout state, meta) of the newest complete checkpoint."""
    folder = resume_folder(root)
    try:
        rollout = json.loads((folder / "rollout.json").read_text())
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError, RuntimeError) as e:
        raise RLXError(f"--resume: checkpoint {folder} is unreadable: {e}") from e
    return folder, rollout, meta


def _no_space(e: BaseException, root: Path) -> bool:
    """Whether a failed write failed for want of space: ENOSPC anywhere in the chain, or a writer that hides
    the errno (torch's zip writer: "file write failed") on a filesystem that is now (nearly) full."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    if "write failed" in str(e) or "failed writing" in str(e):
        try:
            return shutil.disk_usage(root).free < 64 << 20
        except OSError:
            return False
    return False


def _filesystem(path: Path) -> str:
    """The device and mount point holding `path`, for messages: ``/dev/sdb1 (mounted at /data)``."""
    mount = Path(path).resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    device = "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 1 and parts[1] == str(mount):
                device = parts[0]
    except OSError:
        pass
    return f"{device} (mounted at {mount})"
