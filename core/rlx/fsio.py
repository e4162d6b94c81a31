"""Durable writes: what must survive a crash of the machine, not only of the process (checkpoints, published
weight versions), is fsynced before it is renamed into place."""

from __future__ import annotations

import os
from pathlib import Path


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: files created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file and directory under `folder`, and `folder` itself."""
    for dirpath, _, files in os.walk(folder):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))
