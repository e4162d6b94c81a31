"""Weight-only INT4 (W4A16) as rlx's INT4 rollout serves it (``rollout.quantization: int4``) and its quantisation-aware
training (``train.qat: int4``) computes: symmetric, one float32 scale per group of `GROUP` consecutive input columns of
each row (the last group of a row ragged), the weight being ``q * scale`` with ``q`` in -8..7 (``scale`` the group's
largest magnitude over 7). A pushed weight travels as ``uint8`` [rows, ceil(cols / 2)] with two values per byte (the
even column in the low nibble, as ``q + 8``) beside ``{name}_scale`` [rows, groups]: a quarter of a bf16 weight's
bytes and its scales. The tensors quantised are those FP8 releases quantise (`rlx.models.fp8.QUANTISED`: the decoder
layers' linear projections)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GROUP = 128
SCALE = "_scale"  # a weight's scales travel as its name with this appended


def _groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """`w` [rows, cols] as [rows, groups, group] (zero-padded), and the padding."""
    import torch

    pad = (-w.shape[1]) % group
    return torch.nn.functional.pad(w, (0, pad)).reshape(w.shape[0], -1, group), pad


def scales(w: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """Each group's scale, [rows, groups] float32 (1 for a group of zeros)."""
    import torch

    amax = _groups(w.detach().to(torch.float32), group)[0].abs().amax(-1)
    return torch.where(amax > 0, amax / 7, torch.ones_like(amax))


def levels(w: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The integer value of each weight, -8..7 (float32, `w`'s shape)."""
    import torch

    g, pad = _groups(w.to(torch.float32), group)
    q = torch.round(g / scale[..., None]).clamp(-8, 7).reshape(w.shape[0], -1)
    return q[:, :w.shape[1]]


def fake_quantize(w: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """``q * scale``, what an engine serving `w` in INT4 computes with, in `w`'s dtype."""
    s = scales(w, group)
    return (levels(w, s, group) * s.repeat_interleave(group, 1)[:, :w.shape[1]]).to(w.dtype)


def quantize(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scale)``: the uint8 [rows, ceil(cols / 2)] nibbles and the [rows, groups] float32 scales."""
    import torch

    s = scales(w, group)
    q = (levels(w, s, group) + 8).to(torch.uint8)
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1), value=8)
    return q[:, 0::2] | (q[:, 1::2] << 4), s


def dequantize(packed: torch.Tensor, scale: torch.Tensor, cols: int, group: int = GROUP) -> torch.Tensor:
    """float32 [rows, cols] from `quantize`'s pair."""
    import torch

    q = torch.stack(((packed & 0xF), (packed >> 4)), -1).reshape(packed.shape[0], -1)[:, :cols]
    return (q.to(torch.float32) - 8) * scale.repeat_interleave(group, 1)[:, :cols]


def quantized(named: Iterable[tuple[str, torch.Tensor]], group: int = GROUP) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` as an INT4 engine holds it: each `QUANTISED` weight as its packed values and then its scales, the rest
    as they come (one tensor at a time, as a push streams them)."""
    from rlx.models.fp8 import QUANTISED, each_quantized

    return each_quantized(named, lambda t: quantize(t, group), QUANTISED.match, SCALE)
