"""Helpers for model plugins' tests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def spread_weights(model: torch.nn.Module, bias_std: float = 0.2) -> None:
    """Redraw a tiny random model's weights wide enough that expert routing (top-k, groups) is decided well above
    float noise, so megatron and transformers pick the same experts: matrices N(0, 0.3), vectors 1 + N(0, 0.1),
    and DeepSeek-style correction biases (``e_score_correction_bias``) N(0, `bias_std`). Draws from torch's global
    generator, in parameter order and then module order."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.3 if p.dim() > 1 else 0.1)
            if p.dim() == 1:
                p.add_(1.0)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0, bias_std)


def fp8_checkpoint(source: str | Path, out: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """`source` (an HF checkpoint folder) as its publisher's FP8 release would hold it, in `out` (which may be
    `source`): every linear projection in the
    decoder layers (``model.layers.*_proj.weight``, experts' included) as float8_e4m3fn with a ``weight_scale_inv`` of
    one scale per `block`, and ``quantization_config`` in config.json; embeddings, norms, routers and the LM head as
    they were (DeepSeek-V3's FP8 layout)."""
    import json
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from rlx.models.fp8 import SCALE, quantize

    source, out = Path(source), Path(out)
    if source.resolve() != out.resolve():
        shutil.copytree(source, out, dirs_exist_ok=True)
    quantised = re.compile(r"(.*\.)?model\.layers\.\d+\..*_proj\.weight$")
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name in [n for n, t in tensors.items() if quantised.match(n) and t.dim() == 2]:
            tensors[name], tensors[name + SCALE] = quantize(tensors[name], block)
        save_file(tensors, str(f), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"].update({n + SCALE: f for n, f in list(doc["weight_map"].items()) if quantised.match(n)})
        index.write_text(json.dumps(doc))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
