"""Helpers for model plugins' tests."""

from __future__ import annotations

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
