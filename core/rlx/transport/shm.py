"""Same-host weight pushes through shared memory: the bytes never go through HTTP.

The trainer copies a bucket of tensors into one file under ``/dev/shm`` (a `Segment`, reused bucket after
bucket and push after push) and sends only a handle per tensor — file name, offset, dtype, shape — inside
the ordinary ``/update_weights_from_tensor`` payload (`rlx.transport.payloads`). The engine maps the file
(`Attachments`) and copies each tensor straight into its parameter: two memory copies per push, against
pickling, base64 and JSON for tensors sent by value.

Choices:
- A plain file in ``/dev/shm`` rather than ``multiprocessing.shared_memory``: Python 3.11's resource tracker
  would unlink the segment when an engine that attached it exits, and warn about "leaks".
- The file is allocated up front (``posix_fallocate``): a tmpfs that is too small (Docker's default
  ``/dev/shm`` is 64 MB) fails here with a clear error instead of a SIGBUS at the first write.
- The trainer holds a lock (``flock``) on its segment while it lives; a new segment removes the files nobody
  holds (trainers that died without cleaning up), which works across PID namespaces sharing ``/dev/shm``.
- The engine only opens regular files whose names look like ours, in the shared-memory folder, without
  following links: a request cannot make it read other files.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path

import torch


class WireError(ValueError):
    """A weight-update payload (or a shared-memory handle in one) that cannot be decoded into named tensors."""

PREFIX = "rlx-weights-"
_NAME = re.compile(rf"^{PREFIX}\d+-[0-9a-f]+$")
ALIGN = 64  # bytes: every tensor starts on a cache line (and on its element size)


def shm_dir() -> Path:
    """Where segments live: ``/dev/shm`` (memory), else the temporary folder (macOS: page cache)."""
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


class SharedMemoryError(OSError):
    """A segment that cannot be made (no room in the shared-memory folder)."""


def remove_stale(folder: Path | None = None) -> list[Path]:
    """Remove the segments no live trainer holds (one killed mid-push); what was removed."""
    removed = []
    for p in (folder or shm_dir()).glob(PREFIX + "*"):
        if not _NAME.match(p.name):
            continue
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its trainer is alive
            continue
        else:
            p.unlink(missing_ok=True)
            removed.append(p)
        finally:
            os.close(fd)
    return removed


class Segment:
    """The trainer side: one shared file, grown when a bucket needs more room, removed by `close`."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder or shm_dir()
        self.path: Path | None = None
        self.size = 0
        self._fd: int | None = None  # kept open, locked, while the segment lives
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None

    @staticmethod
    def layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
        """Each tensor's byte offset, and the bytes they take together."""
        offsets, end = [], 0
        for _, t in named:
            end = -(-end // ALIGN) * ALIGN
            offsets.append(end)
            end += t.numel() * t.element_size()
        return offsets, end

    def _reserve(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        self.close()
        remove_stale(self.folder)
        size = -(-max(nbytes, 1) // (1 << 20)) << 20  # whole MBs
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = self.folder / ("." + name)  # named as a segment only once locked: `remove_stale` never sees it unheld
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(path, self.folder / name)
            path = self.folder / name
            allocate = getattr(os, "posix_fallocate", None)  # not on macOS: a plain size there
            try:
                allocate(fd, 0, size) if allocate is not None else os.ftruncate(fd, size)
            except OSError as e:
                raise SharedMemoryError(
                    f"cannot allocate {size >> 20} MB in {self.folder} for weight sync ({e.strerror}); free space "
                    f"there (a container's /dev/shm: --shm-size), lower the transport's bucket_mb, or set "
                    f"shared_memory: false") from None
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd, self.path, self.size = fd, path, size
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def pack(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, SharedTensor]]:
        """Copy the tensors in (CPU tensors of any layout; the copy itself uses torch's threads) and return
        their handles, in order."""
        offsets, total = self.layout(named)
        self._reserve(total)
        assert self._bytes is not None and self.path is not None
        out = []
        with torch.no_grad():
            for (name, t), off in zip(named, offsets, strict=True):
                n = t.numel() * t.element_size()
                self._bytes[off:off + n].view(t.dtype).view(t.shape).copy_(t.detach())
                out.append((name, SharedTensor(self.path.name, off, str(t.dtype).removeprefix("torch."),
                                               tuple(t.shape))))
        return out

    def close(self) -> None:
        self._bytes = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path, self.size = None, 0
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):  # a transport that was never closed still removes its file
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class SharedTensor:
    """A tensor's handle in a segment; pickles as a call of `shared_tensor` (which `Attachments` answers)."""

    def __init__(self, file: str, offset: int, dtype: str, shape: tuple[int, ...]):
        self.file, self.offset, self.dtype, self.shape = file, offset, dtype, shape

    def __reduce__(self):
        return shared_tensor, (self.file, self.offset, self.dtype, self.shape)


def shared_tensor(file: str, offset: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The name a payload's handles are pickled under; a payload is read with `Attachments`, never by this."""
    raise RuntimeError("shared-memory handles are read by rlx.transport.payloads's unpickler")


class Attachments:
    """The engine side: maps each segment a payload names (once per payload) and returns views into it. A
    view keeps its mapping alive; the mapping goes when the last view does."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder or shm_dir()
        self.files: dict[str, torch.Tensor] = {}

    def tensor(self, file: str, offset: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        if not isinstance(file, str) or not _NAME.match(file):
            raise WireError(f"shared-memory handle names {file!r}, not a weight-sync segment")
        if file not in self.files:
            path = self.folder / file
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                raise WireError(f"shared-memory segment {path} is not on this engine's host (or is gone): "
                                f"engines on other hosts need a transport that crosses hosts (broadcast, disk, "
                                f"or tensor with shared_memory: false)") from None
            except OSError as e:
                raise WireError(f"shared-memory segment {path}: {e.strerror}") from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise WireError(f"shared-memory segment {path} is not a regular file")
                # private and copy-on-write: writable for torch, never written
                self.files[file] = torch.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
            finally:
                os.close(fd)
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise WireError(f"shared-memory handle with unknown dtype {dtype!r}")
        whole = self.files[file]
        n = dt.itemsize
        for s in shape:
            n *= s
        if offset < 0 or offset % dt.itemsize or offset + n > whole.numel():
            raise WireError(f"shared-memory handle [{offset}, {offset + n}) outside {file} ({whole.numel()} bytes)")
        return whole[offset:offset + n].view(dt).view(tuple(shape))
