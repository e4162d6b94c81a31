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


def with_mtp_layer(folder: str | Path) -> Path:
    """Give the HF checkpoint in `folder` the multi-token-prediction layer DeepSeek-V3 and GLM-4.5 publish after their
    last layer (``model.layers.{num_hidden_layers}``: a decoder layer, ``enorm``, ``hnorm``, ``eh_proj``, its own
    ``embed_tokens`` and ``shared_head``), and ``num_nextn_predict_layers: 1`` in config.json. Its tensors are the last
    layer's and the model's own, perturbed: a trainer that took them for a layer of its own would show it."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    n = config["num_hidden_layers"]
    files = sorted(folder.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    mtp = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v + 0.01
           for k, v in tensors.items() if k.startswith(f"model.layers.{n - 1}.")}
    g = torch.Generator().manual_seed(7)
    mtp.update({f"model.layers.{n}.enorm.weight": torch.ones(hidden),
                f"model.layers.{n}.hnorm.weight": torch.ones(hidden),
                f"model.layers.{n}.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.02,
                f"model.layers.{n}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                f"model.layers.{n}.shared_head.norm.weight": torch.ones(hidden),
                f"model.layers.{n}.shared_head.head.weight": tensors.get("lm_head.weight",
                                                                         tensors["model.embed_tokens.weight"]).clone()})
    save_file(mtp, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists() or len(files) == 1:
        doc = json.loads(index.read_text()) if index.exists() else {
            "metadata": {}, "weight_map": dict.fromkeys(tensors, files[0].name)}
        doc["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
        index.write_text(json.dumps(doc))
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=1))
    return folder
