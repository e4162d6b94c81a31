"""MTP drafts (``--speculative-algorithm EAGLE`` over a checkpoint's multi-token-prediction layer, SGLang's NEXTN):
the checkpoint's first MTP layer, as DeepSeek-V3's report defines it and rlx trains it (`rlx.train.mtp`), drafts the
token after next from the target's last hidden state and the next token:
``shared_head(layer(eh_proj([enorm(embed(x_{i+1})); hnorm(h_i)])))``, and drafts further tokens from its own output
in place of ``h`` (EAGLE's chain, top-k 1).

The layer computes with the tensors the engine holds for it (`weights.name_as_checkpoint`): its decoder layer's
parameters are those tensors (the held names are made views of the layer's), so a push of the MTP weights, which a
run that trains them makes (``train.objective.mtp_loss_coef``), changes the drafts at once; the embeddings, norms,
``eh_proj`` and ``shared_head`` are read from the held tensors at each call.

Its KV (one layer) is kept beside the target's, column for column (`scheduler.Scheduler`): the column that holds
token ``x_t`` holds the MTP layer's entry for position ``t - 1`` (input ``[x_t; h_{t-1}]``), so a row's first
column holds none (`mask`)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlx.types import HFModel, KVCache

_FUNCTIONAL = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
               "shared_head.head.weight", "embed_tokens.weight")


class MTPDraft:
    def __init__(self, model: HFModel):
        text = model.config.get_text_config()
        n = text.num_hidden_layers
        held: dict[str, torch.Tensor] = getattr(model, "rlx_held", {})
        self.prefix = f"model.layers.{n}."
        if not getattr(text, "num_nextn_predict_layers", 0) or not any(k.startswith(self.prefix) for k in held):
            raise ValueError(f"MTP drafts: {model.config.model_type} has no multi-token-prediction layer in its "
                             f"checkpoint (num_nextn_predict_layers, model.layers.{n}.*)")
        if getattr(text, "index_topk", None):
            raise ValueError("MTP drafts: a sparse-attention MTP layer (DeepSeek-V3.2's, GLM-5's) keeps an indexer "
                             "cache the embedded engine does not draft with; use ngram or draft_model drafts")
        self.model = model
        cfg = copy.deepcopy(text)
        for k, v in list(vars(cfg).items()):  # per-layer kinds: the MTP layer is of the last layer's
            if isinstance(v, list) and len(v) == n:
                setattr(cfg, k, [*v, v[-1]])
        cfg.num_hidden_layers = n + 1
        like = next(model.parameters())
        with torch.device("meta"):  # (no initialisation: `bind` sets every tensor)
            layer = type(model.model.layers[-1])(cfg, n)
        self.layer = layer.to_empty(device=like.device).to(like.dtype).eval().requires_grad_(False)
        for m in self.layer.modules():  # its KV is layer 0 of its own cache
            if hasattr(m, "layer_idx"):
                m.layer_idx = 0
        self.eps = text.rms_norm_eps
        # (rid, position i, the first draft's logits from [x_{i+1}; h_i]) per row and step, where a test asks
        self.trace: list[tuple[str, int, torch.Tensor]] | None = None
        if not hasattr(model, "rlx_final_hidden"):  # (once per model, however many drafts are made for it)
            model.rlx_final_hidden = None
            model.model.norm.register_forward_hook(lambda m, args, out: setattr(model, "rlx_final_hidden", out))
        self.bind()

    @property
    def hidden(self) -> torch.Tensor | None:
        """The target's last forward's final hidden states ``[B, T, H]``."""
        return self.model.rlx_final_hidden

    def bind(self) -> None:
        """Make the held MTP tensors views of the layer's parameters (their values copied in): a push by name then
        writes the layer. Again after the model moves (memory release and resume), which replaces the held tensors."""
        from rlx.rollout.engines.embedded.weights import served_state

        like = next(self.model.parameters())
        self.layer.to(like.device)
        held: dict[str, torch.Tensor] = self.model.rlx_held
        views = served_state(self.layer, held=False)
        missing = sorted(self.prefix + k for k in views if self.prefix + k not in held)
        if missing:
            raise ValueError(f"MTP drafts: the checkpoint's MTP layer has no {missing[0]!r}")
        with torch.no_grad():
            for name, view in views.items():
                view.copy_(held[self.prefix + name])
                held[self.prefix + name] = view
        # the embeddings and the head, where the checkpoint stores them once, as the main model's
        shared = {"embed_tokens.weight": self.model.get_input_embeddings().weight,
                  "shared_head.head.weight": self.model.get_output_embeddings().weight}
        self.w: dict[str, torch.Tensor] = {**shared, **{k: held[self.prefix + k] for k in _FUNCTIONAL
                                                       if self.prefix + k in held}}
        if self.w.keys() != set(_FUNCTIONAL):
            raise ValueError(f"MTP drafts: the checkpoint's MTP layer has no "
                             f"{self.prefix + sorted(set(_FUNCTIONAL) - self.w.keys())[0]!r}")

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.w[name], self.eps)

    def __call__(self, tokens: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """The layer over `tokens` ``[B, T]`` (``x_{i+1}``) and `hidden` ``[B, T, H]`` (``h_i``) at `positions` (``i``),
        appending T columns to `cache` (a fresh one when None); `mask` ``[B, L]``: the columns each row attends to,
        the T new ones last. Returns (its output, the draft logits, the cache)."""
        from transformers import DynamicCache

        cache = DynamicCache() if cache is None else cache
        e = torch.nn.functional.embedding(tokens, self.w["embed_tokens.weight"])
        hidden = hidden.to(e.dtype)
        x = torch.cat([self._norm(e, "enorm.weight"), self._norm(hidden, "hnorm.weight")], -1) @ self.w["eh_proj.weight"].T
        b, t = tokens.shape
        width = mask.shape[1]
        col = torch.arange(width, device=mask.device)[None, None, :]
        row = (width - t + torch.arange(t, device=mask.device))[None, :, None]
        # causal over the columns a row has, and each query its own column (a row's first column has no entry: its
        # query would otherwise see nothing)
        allowed = ((mask[:, None, :] > 0) & (col <= row)) | (col == row)
        bias = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
        positions = positions.clamp(min=0)
        out = self.layer(x, attention_mask=bias[:, None], position_ids=positions, cache=cache, use_cache=True,
                         position_embeddings=self.model.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        return out, self._norm(out, "shared_head.norm.weight") @ self.w["shared_head.head.weight"].T, cache


def mask(m: torch.Tensor) -> torch.Tensor:
    """The MTP layer's columns of a batch whose target columns are `m` ``[B, L]``: each row's but its first."""
    return m * torch.nn.functional.pad(m[:, :-1], (1, 0))
