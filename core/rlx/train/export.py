"""HF export of the actor: what ``rl train --save-hf`` and ``rl eval --checkpoint`` write."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.train.spec import HFCheckpoint
from rlx.transport import buckets
from rlx.transport.sender import agree

if TYPE_CHECKING:
    from rlx.train.trainer import Trainer

SHARD_BYTES = 1 << 30  # at most this many bytes per safetensors file


def export_hf(trainer: Trainer, folder: Path) -> None:
    """An HF checkpoint transformers loads: the original config and tokenizer, the actor's weights in
    safetensors shards of at most 1 GB written by each stage's sender, what the trainer does not hold copied
    unchanged from the original checkpoint (`ModelSpec.carried`: a wrapper's vision tower, untrained MTP layers), and
    their index. `folder` must be on storage every trainer host sees (with pipeline stages on several hosts)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    par = trainer.par

    written: dict[str, Any] = {"map": {}, "bytes": 0}

    def write() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        named = trainer.hf_tensors()
        try:
            if par.sender:
                for i, bucket in enumerate(buckets(named, SHARD_BYTES)):
                    fname = f"model-s{par.pp_rank:02d}-{i:05d}.safetensors"
                    tensors = {n: t.detach().contiguous().cpu() for n, t in bucket}
                    save_file(tensors, str(folder / fname), metadata={"format": "pt"})
                    written["map"].update(dict.fromkeys(tensors, fname))
                    written["bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        finally:
            if par.gathers:
                for _ in named:
                    pass

    agree(par, write)
    parts: list[Any] = [None] * par.world
    dist.all_gather_object(parts, written)

    def index() -> None:
        if par.rank != 0:
            return
        for f in Path(trainer.model_path).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, folder / f.name)
        merged = {k: v for p in parts for k, v in p["map"].items()}
        total = sum(p["bytes"] for p in parts)
        source = HFCheckpoint(trainer.model_path)
        carried = [n for n in trainer.spec.carried(source.names()) if n not in merged]
        for i, bucket in enumerate(buckets(((n, source.get(n)) for n in carried), SHARD_BYTES)):
            fname = f"model-carried-{i:05d}.safetensors"
            save_file(dict(bucket), str(folder / fname), metadata={"format": "pt"})
            merged.update(dict.fromkeys((n for n, _ in bucket), fname))
            total += sum(t.numel() * t.element_size() for _, t in bucket)
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(merged.items()))}, indent=1))

    agree(par, index)
