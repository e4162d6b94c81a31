"""The published format: self-describing version folders of full checkpoints or lossless deltas.

``<root>/weight_v{N:06d}/`` holds ``manifest.json`` and the tensor files of version N:

* a **full** version is an HF safetensors checkpoint (``model-sXX-NNNNN.safetensors``, one series per
  sending rank), loadable as it is;
* a **delta** version holds, per tensor, the zstd-compressed difference between its bytes in version N and
  in the base version N-1, as whichever is smaller: ``xor`` (the bytes XOR the base's; unchanged bytes are
  zeros) or ``sparse`` (positions of the changed elements, delta-coded, and their new values).

The manifest names the version, its base, the dtype and, per tensor, its file, encoding, shape, dtype and an
xxh3-128 checksum of the tensor's bytes *after* applying (what the engine must end up serving). A folder is
built as ``weight_v{N:06d}.tmp``, every file fsynced, and renamed: it exists complete or not at all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rlx.fsio import fsync_path, fsync_tree, write_synced

MANIFEST = "manifest.json"
FORMAT = "rlx-delta/1"


class DeltaError(RuntimeError):
    """A published version that cannot be used: missing, incomplete, corrupt or not matching its base."""


def engine_slug(url: str) -> str:
    """A file name for an engine's URL (its agent's status file in the store: ``agents/<slug>.json``)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", url).strip("-")


def folder_name(version: int) -> str:
    return f"weight_v{version:06d}"


def version_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("weight_v") or name.endswith(".tmp") or not name[8:].isdigit():
        return None
    return int(name[8:])


def published(root: Path) -> dict[int, Path]:
    """The complete version folders under `root`, by version."""
    out = {}
    if root.is_dir():
        for p in root.iterdir():
            v = version_of(p)
            if v is not None and (p / MANIFEST).is_file():
                out[v] = p
    return dict(sorted(out.items()))


def to_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes (uint8), contiguous, on CPU."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().copy()


def checksum(raw: np.ndarray | bytes) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(raw.data.cast("B") if not isinstance(raw, bytes) else raw)


def _zstd():
    import zstandard

    return zstandard


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _elements(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """A tensor's bytes as one unsigned integer per element (or rows of `itemsize` bytes for odd sizes)."""
    return raw.view(_UINT[itemsize]) if itemsize in _UINT else raw.reshape(-1, itemsize)


def encode(new: np.ndarray, old: np.ndarray | None, itemsize: int, level: int = 3) -> tuple[str, bytes]:
    """The smaller lossless encoding of `new` given `old` (same length): ``(encoding, compressed bytes)``;
    ``full`` when there is no base."""
    z = _zstd().ZstdCompressor(level=level)
    if old is None:
        return "full", z.compress(new.tobytes())
    if new.size != old.size:
        raise DeltaError(f"a tensor changed size ({old.size} -> {new.size} bytes): publish a full version")
    xor = z.compress(np.bitwise_xor(new, old))
    elems_new, elems_old = _elements(new, itemsize), _elements(old, itemsize)
    differs = elems_new != elems_old if elems_new.ndim == 1 else (elems_new != elems_old).any(axis=1)
    count = int(np.count_nonzero(differs))
    # positions + values as large as the tensor itself (a dense change) never beat the XOR: skip building them
    if count * (4 + itemsize) >= new.size or elems_new.shape[0] > 1 << 32:
        return "xor", xor
    changed = np.flatnonzero(differs)
    del differs
    gaps = np.diff(changed, prepend=0).astype(np.uint32) if count else np.zeros(0, np.uint32)
    sparse = z.compress(np.uint64(changed.size).tobytes() + gaps.tobytes() + elems_new[changed].tobytes())
    return ("sparse", sparse) if len(sparse) < len(xor) else ("xor", xor)


def decode(encoding: str, blob: bytes, old: np.ndarray | None, nbytes: int, itemsize: int) -> np.ndarray:
    """The new bytes from an encoded blob and the base's bytes."""
    try:
        raw = _zstd().ZstdDecompressor().decompress(blob, max_output_size=max(nbytes, 1) + 16)
    except Exception as e:  # zstandard raises its own error type for corrupt frames
        raise DeltaError(f"corrupt data ({type(e).__name__}: {e})") from None
    if encoding == "full":
        out = np.frombuffer(raw, np.uint8).copy()
    elif old is None:
        raise DeltaError(f"a {encoding} delta needs the base version's tensor")
    elif encoding == "xor":
        out = np.bitwise_xor(np.frombuffer(raw, np.uint8), old)
    elif encoding == "sparse":
        if len(raw) < 8:
            raise DeltaError("corrupt sparse delta (no count)")
        count = int(np.frombuffer(raw[:8], np.uint64)[0])
        if 8 + 4 * count > len(raw):
            raise DeltaError("corrupt sparse delta (fewer positions than its count)")
        gaps = np.frombuffer(raw[8:8 + 4 * count], np.uint32).astype(np.int64)
        values = _elements(np.frombuffer(raw[8 + 4 * count:], np.uint8), itemsize) \
            if (len(raw) - 8 - 4 * count) % itemsize == 0 else None
        if values is None or values.shape[0] != count:
            raise DeltaError("corrupt sparse delta (values do not match positions)")
        out = _elements(old.copy(), itemsize)
        idx = np.cumsum(gaps)
        if count and (idx[-1] >= out.shape[0] or idx.min() < 0):
            raise DeltaError("corrupt sparse delta (a position past the tensor)")
        out[idx] = values
        out = out.reshape(-1).view(np.uint8)
    else:
        raise DeltaError(f"unknown encoding {encoding!r}")
    if out.size != nbytes:
        raise DeltaError(f"decoded {out.size} bytes where the manifest says {nbytes}")
    return out


def from_bytes(raw: np.ndarray, dtype: str, shape: list[int], copy: bool = True) -> torch.Tensor:
    """A tensor from its bytes; with ``copy=False`` it shares `raw`'s memory."""
    return torch.from_numpy(raw.copy() if copy else raw).view(getattr(torch, dtype)).reshape(shape)


fsync_dir = fsync_path  # the names this package's modules use
write_file = write_synced


def remove_folder(path: Path) -> None:
    """Delete a version folder so that no reader sees it half-deleted: renamed away (no longer a version
    name, atomic), then removed."""
    if not path.exists():
        return
    gone = path.with_name(f"{path.name}.deleting-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def finish_folder(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest into `tmp`, fsync everything, and rename it to `final` (atomic on one filesystem)."""
    write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    fsync_tree(tmp)
    remove_folder(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        m = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise DeltaError(f"{folder}: no {MANIFEST} (an incomplete or deleted version)") from None
    except ValueError as e:
        raise DeltaError(f"{folder / MANIFEST}: not valid JSON ({e})") from None
    if m.get("format") != FORMAT:
        raise DeltaError(f"{folder / MANIFEST}: format {m.get('format')!r}, expected {FORMAT!r}")
    return m
