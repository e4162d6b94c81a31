"""HF export of the actor: what ``rl train --save-hf`` and ``rl eval --checkpoint`` write."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.models.fp8 import SCALE, quantized
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
    their index. `folder` must be on storage every trainer host sees (with pipeline stages on several hosts). With
    ``train.lora`` the weights are the merged ones, and `export_adapter` writes the adapters in `folder`/adapter; with
    several (``train.lora.adapters``) the weights are the base model's, and each adapter is in `folder`/adapter-<name>."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    par = trainer.par
    source = HFCheckpoint(trainer.model_path)
    fp8 = trainer.cfg.model.export_weights == "fp8"  # (preflight: the source is an FP8 checkpoint)
    written: dict[str, Any] = {"map": {}, "bytes": 0}

    def write() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        named = trainer.hf_tensors()
        try:
            if par.sender:
                stream = (quantized(named, source.fp8_block, lambda n: n + SCALE in source)  # as the source has them
                          if fp8 and source.fp8_block else named)
                for i, bucket in enumerate(buckets(stream, SHARD_BYTES)):
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
        if source.fp8_block is not None and not fp8:  # the weights written are the trainer's dtype: not quantised
            config = json.loads((folder / "config.json").read_text())
            config.pop("quantization_config", None)
            (folder / "config.json").write_text(json.dumps(config, indent=2))
        merged = {k: v for p in parts for k, v in p["map"].items()}
        total = sum(p["bytes"] for p in parts)
        carried = [n for n in trainer.spec.carried(source.names()) if n not in merged]
        if not fp8:  # carried FP8 weights are written dequantised (`get`), without their scales
            carried = [n for n in carried if not n.endswith(SCALE)]
        read = source.stored if fp8 else source.get
        for i, bucket in enumerate(buckets(((n, read(n)) for n in carried), SHARD_BYTES)):
            fname = f"model-carried-{i:05d}.safetensors"
            save_file(dict(bucket), str(folder / fname), metadata={"format": "pt"})
            merged.update(dict.fromkeys((n for n, _ in bucket), fname))
            total += sum(t.numel() * t.element_size() for _, t in bucket)
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(merged.items()))}, indent=1))

    agree(par, index)
    for key in trainer.actor.lora_keys:
        export_adapter(trainer, folder / ("adapter" if key is None else f"adapter-{key}"), key)


def export_adapter(trainer: Trainer, folder: Path, key: str | None = None) -> None:
    """The actor's LoRA adapters (``train.lora``) as peft saves them: ``adapter_config.json`` and
    ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``, ``lora_B``), for the transformers
    model of the original checkpoint (``PeftModel.from_pretrained``). Written by rank 0 (adapters are small); not
    with adapters on experts, whose transformers modules are fused (peft has no adapters per expert there)."""
    import sys

    from rlx.transport.payloads import save_peft_adapter

    if trainer.adapts_experts():
        if trainer.par.rank == 0:
            print(f"rlx: warning: no peft adapter in {folder}: the adapters on experts have no peft form for "
                  f"transformers' fused experts (the merged checkpoint beside it has them)", file=sys.stderr)
        return
    tensors = trainer.adapter_tensors(key)
    if tensors is None:  # (rank 0 writes)
        return
    save_peft_adapter(folder, tensors, trainer.adapter_config(tensors))
