"""Block-quantised FP8 weights as DeepSeek, GLM, Kimi and Qwen publish them: ``float8_e4m3fn`` tensors beside a
``{name}_scale_inv`` of one float32 scale per block (``quantization_config.weight_block_size``, 128 x 128), the
weight being ``fp8 * scale_inv`` blockwise (edge blocks ragged). rlx reads them dequantised for training
(`HFCheckpoint`), writes them back quantised from the trained weights when asked (``model.export_weights: fp8``),
with the same scales transformers' and SGLang's FP8 kernels read, and quantises its pushes to engines that serve FP8
(``rollout.quantization: fp8``, `quantized`)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE = "_scale_inv"  # the scale tensor's name is the weight's with this appended
BLOCK = (128, 128)  # DeepSeek's, GLM's and Qwen's FP8 releases' block
#: the tensors rlx quantises for low-precision engines (an FP8 copy it writes, INT4): the attention and MLP projections
#: of the decoder layers, experts' included (Mixtral-style ``w1``/``w2``/``w3`` too), under a wrapper's prefix too; not
#: the embeddings, norms, routers, LM head, latent attention's ``kv_a_proj_with_mqa``, sparse attention's indexer,
#: gated delta nets' projections or an MTP layer's ``eh_proj``. `rlx.train.qat.QUANTISED` names the same in megatron.
QUANTISED = re.compile(r"^(.*\.)?layers\.\d+\.(self_attn|mlp|block_sparse_moe)\.(.*\.)?"
                       r"(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|down_proj|w1|w2|w3)"
                       r"\.weight$")


def block_size(folder: str | Path) -> tuple[int, int] | None:
    """The checkpoint's FP8 block size (``quantization_config`` in its config.json), or None if it is not FP8."""
    try:
        q = json.loads((Path(folder) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return None
    if q.get("quant_method") != "fp8":
        return None
    rows, cols = q.get("weight_block_size") or (128, 128)
    return int(rows), int(cols)


def _expand(scale: torch.Tensor, block: tuple[int, int], rows: range, cols: range) -> torch.Tensor:
    """The per-element scale of the weight's rows `rows` and columns `cols` from the per-block `scale`."""
    out = scale
    for dim, (span, size) in enumerate(((rows, block[0]), (cols, block[1]))):
        first, last = span.start // size, (span.stop - 1) // size + 1
        out = out.narrow(dim, first, last - first).repeat_interleave(size, dim)
        out = out.narrow(dim, span.start - first * size, len(span))
    return out


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], rows: range | None = None,
               cols: range | None = None) -> torch.Tensor:
    """float32 ``weight * scale_inv`` blockwise; `weight` holds rows `rows` and columns `cols` of the whole (a
    tensor-parallel slice; all of them when None)."""
    import torch

    rows = range(weight.shape[0]) if rows is None else rows
    cols = range(weight.shape[1]) if cols is None else cols
    return weight.to(torch.float32) * _expand(scale.to(torch.float32), block, rows, cols)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, scale_inv)``: each block scaled so that its largest magnitude is e4m3's largest (a block of zeros keeps
    scale 1), rounded to nearest."""
    import torch

    w = weight.to(torch.float32)
    r, c = w.shape
    br, bc = block
    pad = torch.nn.functional.pad(w.abs(), (0, (-c) % bc, 0, (-r) % br))
    amax = pad.reshape(pad.shape[0] // br, br, pad.shape[1] // bc, bc).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / _expand(scale, block, range(r), range(c))).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def is_fp8(t: Any) -> bool:
    import torch

    return getattr(t, "dtype", None) in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantized(named: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
              stored: Callable[[str], Any] = QUANTISED.match) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` as an FP8 checkpoint stores it: each weight `stored` says is quantised (default: `QUANTISED`) as its
    FP8 tensor and then its scales, the rest as they come (one tensor at a time, as a push streams them)."""
    return each_quantized(named, lambda t: quantize(t, block), stored, SCALE)


def each_quantized(named: Iterable[tuple[str, torch.Tensor]],
                   quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], stored: Callable[[str], Any],
                   suffix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` with each 2-D weight `stored` names replaced by `quantize`'s pair: the values under its name, then the
    scales under the name with `suffix` (FP8 here, INT4 in `rlx.models.int4`)."""
    for name, t in named:
        if stored(name) and t.dim() == 2:
            q, scale = quantize(t.detach())  # (where the weight is: a GPU trainer's pushes stay on it)
            yield name, q
            yield name + suffix, scale
        else:
            yield name, t


def write_quantized(source: str | Path, out: str | Path, block: tuple[int, int] = BLOCK) -> Path:
    """`source` (an HF checkpoint folder) as its publisher's FP8 release would hold it, in `out` (which may be
    `source`): the `QUANTISED` weights as float8_e4m3fn with a ``weight_scale_inv`` of one scale per `block`, and
    ``quantization_config`` in config.json (DeepSeek-V3's FP8 layout)."""
    import shutil

    from safetensors.torch import load_file, save_file

    source, out = Path(source), Path(out)
    if source.resolve() != out.resolve():
        shutil.copytree(source, out, dirs_exist_ok=True)
    for f in sorted(out.glob("*.safetensors")):
        tensors = dict(quantized(load_file(str(f)).items(), block))
        save_file(tensors, str(f), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        written = {n for f in out.glob("*.safetensors") for n in _names(f)}
        doc["weight_map"].update({n + SCALE: f for n, f in list(doc["weight_map"].items()) if n + SCALE in written})
        index.write_text(json.dumps(doc))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def served(model_path: str | Path, output_dir: str | Path) -> Path:
    """The FP8 checkpoint engines serve under ``rollout.quantization: fp8``: `model_path` (an HF checkpoint folder)
    when it is one, else its copy quantised by `write_quantized` in `output_dir`/model-fp8-<source's hash>, written on
    first use (by whichever process gets there first)."""
    import hashlib
    import os
    import shutil

    source = Path(model_path).resolve()
    if block_size(source) is not None:
        return source
    out = Path(output_dir) / f"model-fp8-{hashlib.sha1(str(source).encode()).hexdigest()[:10]}"
    if not (out / "config.json").exists():
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        write_quantized(source, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process wrote it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _names(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as h:
        return list(h.keys())


def stored_quantised(folder: str | Path) -> tuple[tuple[int, int], set[str]]:
    """An FP8 checkpoint's block size and the names of the weights it stores quantised (those with scales)."""
    block = block_size(folder)
    if block is None:
        raise ValueError(f"{folder} is not an FP8 checkpoint (no quantization_config with quant_method fp8)")
    names = {k[:-len(SCALE)] for f in sorted(Path(folder).glob("*.safetensors")) for k in _names(f) if k.endswith(SCALE)}
    return block, names
