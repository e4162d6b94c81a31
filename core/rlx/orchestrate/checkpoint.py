"""Checkpoints that resume exactly: trainer (model, optimizer, scheduler, RNG), rollout (dataset
cursor, id counters, unfinished groups), step and weight version.

A checkpoint is complete or absent: written to ``<output_dir>/checkpoints/.step_<N>.tmp``, every file
fsynced, marked last with a ``COMPLETE`` file, then renamed to ``step_<N>``. The newest complete one is found
by reading the folders themselves (``latest`` is written for people and tools, never trusted). Each run has
an id, kept across resumes: pruning keeps the newest ``keep`` checkpoints *of this run* and never touches
another run's left in the same folder, and ``--resume`` takes the most recently saved complete checkpoint.
A save that fails (a full disk says so, naming the filesystem and the path) leaves nothing behind, and the
leftovers of a save that was killed are removed by the next one.

With ``train.checkpoint.async_save`` (`Saving`), the trainer ranks copy their state and train on while their files are
written, for as many steps as that takes; the folder becomes a checkpoint (marked, renamed, older ones pruned) once
every file is, so a run killed meanwhile resumes from the checkpoint before.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
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
    return Saving(root, step, trainer, rollout_state, meta, keep).finish()


class Saving:
    """A checkpoint being written: started at once (`trainer.save(folder, background)`, the rollout's state and
    `meta` beside it), whole at `finish`, which marks and renames it, then prunes. Until then the folder is a
    ``.tmp``: a run killed before is resumed from the checkpoint before."""

    def __init__(self, root: Path, step: int, trainer: TrainerGroup, rollout_state: dict[str, Any],
                 meta: dict[str, Any], keep: int = 2, background: bool = False):
        self.root, self.step, self.trainer, self.meta, self.keep = root, step, trainer, meta, keep
        self.background = background
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step_*.tmp"):  # a save killed half way
            shutil.rmtree(stale, ignore_errors=True)
        self.tmp = root / f".step_{step}.tmp"
        body = {"step": step, "saved_at": time.time(), **meta}
        with self._cleaned():
            self.tmp.mkdir()
            trainer.save(self.tmp, background=background)
            (self.tmp / "rollout.json").write_text(json.dumps(rollout_state))
            (self.tmp / "meta.json").write_text(json.dumps(body))

    @contextlib.contextmanager
    def _cleaned(self) -> Iterator[None]:
        """What fails leaves no folder behind (a full disk said as such)."""
        try:
            yield
        except BaseException as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if _no_space(e, self.root):
                raise RLXError(f"no space left on {_filesystem(self.root)} writing checkpoint {self.tmp} "
                               f"({type(e).__name__}: {e}); the previous checkpoint is intact") from e
            raise

    def written(self) -> bool:
        """Every rank's files written and finalised (each role's ``metadata.json``, which megatron writes last)."""
        return not self.background or all((d / "metadata.json").exists() for d in self._roles())

    def _roles(self) -> list[Path]:
        return [p.parent for p in self.tmp.glob("*/layout.pt")]  # (rank 0 writes a role's layout as it saves)

    def finish(self) -> Path:
        """The checkpoint, whole: waits for the ranks' files (`trainer.finish_save`) unless `written`; the trainer
        is not to be called meanwhile."""
        root, tmp, step = self.root, self.tmp, self.step
        final = root / f"step_{step}"
        with self._cleaned():
            if not self.written():
                self.trainer.finish_save()
            fsync_tree(tmp)
            write_synced(tmp / MARKER, json.dumps({"step": step, "run_id": self.meta.get("run_id")}).encode())
            fsync_path(tmp)
            if final.exists():  # the same step saved before (a run restarted in this folder): replaced whole
                gone = root / f".step_{step}.old-{uuid.uuid4().hex[:8]}.tmp"
                os.rename(final, gone)
                shutil.rmtree(gone, ignore_errors=True)
            os.rename(tmp, final)
            fsync_path(root)
        (root / ".latest.tmp").write_text(final.name)
        os.replace(root / ".latest.tmp", root / "latest")
        mine = [(s, f) for s, f, m in complete(root) if m.get("run_id") == self.meta.get("run_id")]
        for _, old in sorted(mine)[:-self.keep]:
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
