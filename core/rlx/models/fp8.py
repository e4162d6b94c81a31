"""Block-quantised FP8 weights as DeepSeek, GLM, Kimi and Qwen publish them: ``float8_e4m3fn`` tensors beside a
``{name}_scale_inv`` of one float32 scale per block (``quantization_config.weight_block_size``, 128 x 128), the
weight being ``fp8 * scale_inv`` blockwise (edge blocks ragged). rlx reads them dequantised for training
(`HFCheckpoint`) and writes them back quantised from the trained weights when asked (``model.export_weights: fp8``),
with the same scales transformers' and SGLang's FP8 kernels read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE = "_scale_inv"  # the scale tensor's name is the weight's with this appended


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
