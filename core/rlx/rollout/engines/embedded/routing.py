"""Routing capture for the embedded engine (``--enable-return-routed-experts``), as SGLang's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rlx.types import HFModel


class RoutedExperts:
    """Records, per forward, the experts every token was routed to in each layer, as SGLang's routed-experts
    capturer does. transformers 5 gives every MoE layer an ``experts`` module called as
    ``experts(hidden_states, top_k_index, top_k_weights)`` on the flattened tokens: a pre-hook on each reads
    ``top_k_index`` there, whatever the family's router. Layers without experts stay 0, as SGLang reports
    ``[tokens, num_hidden_layers, top_k]`` for every layer."""

    def __init__(self, model: HFModel):
        import re

        text = model.config.get_text_config()  # (a vision-language wrapper's language model)
        self.layers = text.num_hidden_layers
        self.topk = int(getattr(text, "num_experts_per_tok", 0) or 0)
        self.found = 0
        self._current: dict[int, torch.Tensor] = {}
        for name, module in model.named_modules():
            m = re.search(r"layers\.(\d+)\.mlp\.experts$", name)
            if m is not None:
                module.register_forward_pre_hook(self._hook(int(m.group(1))))
                self.found += 1
        if not self.found or not self.topk:
            raise ValueError(f"--enable-return-routed-experts: the {model.config.model_type!r} model has no "
                             f"mixture-of-experts layers")

    def _hook(self, layer: int):
        def pre(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if self._current is not None and len(args) > 1:
                self._current[layer] = args[1].detach()
        return pre

    def begin(self) -> None:
        self._current = {}

    def take(self, batch: int, length: int) -> torch.Tensor:
        """This forward's routing as int32 ``[batch, length, layers, top_k]`` (CPU)."""
        out = torch.zeros(batch, length, self.layers, self.topk, dtype=torch.int32)
        for layer, idx in self._current.items():
            out[:, :, layer] = idx.reshape(batch, length, self.topk).to("cpu", torch.int32)
        self._current = {}
        return out
