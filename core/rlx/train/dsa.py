"""DeepSeek sparse attention (DSA: DeepSeek-V3.2's ``deepseek_v32``, GLM-5's ``glm_moe_dsa``) as a `MLADecoderSpec`:
latent attention in which each query attends only to the ``index_topk`` earlier tokens a lightweight indexer scores
highest. megatron-core's local spec has no DSA (its experimental one needs a CUDA Hadamard kernel), so this module
brings the layer; transformers' modeling code is the reference it is checked against.

Per layer, the indexer (``self_attn.indexer.*``: ``wq_b`` from the query latent, ``wk`` and a LayerNorm ``k_norm``
from the hidden states, ``weights_proj``) gives each (query, key) pair the score
``sum_h w_h(x_s) * relu(q_h(s) . k(t) / sqrt(d))`` with rotary embedding on the first ``qk_rope_head_dim`` dimensions
of q and k (interleaved pairs in GLM-5's, halves in DeepSeek-V3.2's); the query keeps its ``index_topk`` best keys
among those the causal (and packed-sample) mask allows, and the attention is masked to them. GLM-5's ``shared``
layers (``indexer_types``) have no indexer: they reuse the selection of the full layer before them.

On megatron: `DSACoreAttention` replaces the core attention of each MLA layer. megatron's MLA hands it the hidden
states and the normed query latent when ``experimental_attention_variant`` is ``dsa`` (megatron-core 0.16.1), which
`DSADecoderSpec` sets. The indexer is replicated on every tensor-parallel rank (every rank computes the same
selection from the same inputs; its weights are small). A pipeline stage must start with a full layer: a shared
layer's selection does not cross stages.

The indexer is not trained by default (``train.objective.indexer_kl_coef: 0``): RL's objective gives it no gradient
(the top-k is not differentiable; transformers and SGLang run it without one), so its weights stay as loaded, are
pushed and exported unchanged, and the engines select with the weights the trainer does. With a coefficient above 0
each full layer's indexer is trained as DeepSeek-V3.2's sparse stage trains it (`indexer_kl`: KL from the
attention's distribution over the kept keys, summed over heads, to the indexer's softmax over them; the indexer's
inputs detached, so the loss moves the indexer alone), added to the backward pass through megatron's
``DSAIndexerLossAutoScaler``; its new weights are pushed with the rest.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from rlx.errors import RLXError
from rlx.train.attention import SDPACoreAttention
from rlx.train.masks import BlockCausal
from rlx.train.mla import MLADecoderSpec, deepseek_v3_spec
from rlx.train.spec import Gather, HFCheckpoint, Stage

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rlx.config import ParallelConfig
    from rlx.types import HFConfig


@dataclass(frozen=True)
class DSAShape:
    heads: int  # index_n_heads
    head_dim: int  # index_head_dim
    topk: int  # index_topk
    rope: int  # qk_rope_head_dim: the rotary part of each indexer query and key
    interleaved: bool  # rotary pairs interleaved (GLM-5) or halves (DeepSeek-V3.2)
    full: tuple[bool, ...]  # per layer: its own indexer (else the previous full layer's selection)
    rotary: Any  # transformers' rotary embedding module of the family: (x, position_ids) -> (cos, sin)


class Selection:
    """The last full layer's selection in a forward pass, for the shared layers after it, and the dense form of the
    pass's mask, made once for all layers (one per model)."""

    keep: torch.Tensor | None = None
    _mask: tuple[Any, torch.Tensor] | None = None

    def blocked(self, mask: BlockCausal | torch.Tensor | None, b: int, s: int, device: torch.device) -> torch.Tensor:
        """[b, s, s], True where a query may not attend to a key."""
        if self._mask is not None and self._mask[0] is mask and mask is not None:
            return self._mask[1]
        if isinstance(mask, BlockCausal):
            blocked = mask.dense()[:, 0].to(device)
        elif mask is not None:
            blocked = mask.bool().expand(b, 1, s, s)[:, 0]
        else:
            blocked = ~torch.ones(s, s, dtype=torch.bool, device=device).tril().expand(b, s, s)
        self._mask = (mask, blocked)
        return blocked


class Indexer(torch.nn.Module):
    """The lightning indexer of one layer; names as the checkpoint's (``wq_b``, ``wk``, ``k_norm``,
    ``weights_proj``). Frozen unless `trained` (``train.objective.indexer_kl_coef``)."""

    def __init__(self, shape: DSAShape, config: TransformerConfig, trained: bool = False):
        super().__init__()
        h, d, dtype = shape.heads, shape.head_dim, config.params_dtype
        self.shape = shape
        self.wq_b = torch.nn.Linear(config.q_lora_rank, h * d, bias=False, dtype=dtype)
        self.wk = torch.nn.Linear(config.hidden_size, d, bias=False, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(d, eps=1e-6, dtype=dtype)
        self.weights_proj = torch.nn.Linear(config.hidden_size, h, bias=False, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(trained)

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on the first `rope` dims of `t` [b, s, heads, d] (cos/sin [b, s, rope]), as transformers
        applies it to the indexer's q and k."""
        r = self.shape.rope
        rot, rest = t[..., :r], t[..., r:]
        cos, sin = cos[:, :, None], sin[:, :, None]
        if self.shape.interleaved:  # pairs (x0, x1), (x2, x3)...: each pair one frequency
            cos, sin = cos[..., : r // 2], sin[..., : r // 2]
            a, b = rot[..., 0::2], rot[..., 1::2]
            rot = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            a, b = rot[..., : r // 2], rot[..., r // 2:]
            rot = rot * cos + torch.cat([-b, a], dim=-1) * sin
        return torch.cat([rot, rest], dim=-1)

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """`x` [s, b, hidden], `q_latent` [s, b, q_lora] (normed), `blocked` [b, s, s] (True: not allowed) -> each
        (query, key) pair's score [b, s, s], -inf where not allowed."""
        h, d = self.shape.heads, self.shape.head_dim
        x, q_latent = x.transpose(0, 1), q_latent.transpose(0, 1)  # [b, s, ...]
        b, s = x.shape[:2]
        q = self.wq_b(q_latent).view(b, s, h, d)
        k = self.k_norm(self.wk(x)).view(b, s, 1, d)
        positions = torch.arange(s, device=x.device)[None].expand(b, s)  # (relative: packed rows need no restart)
        cos, sin = self.shape.rotary.to(x.device)(x, positions)
        q, k = self._rotate(q, cos.to(q.dtype), sin.to(q.dtype)), self._rotate(k, cos.to(k.dtype), sin.to(k.dtype))
        scores = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k[:, :, 0].float()) * d ** -0.5)
        weights = self.weights_proj(x).float() * h ** -0.5  # [b, s, h]
        return torch.einsum("bsh,bsht->bst", weights, scores).masked_fill(blocked, float("-inf"))

    def select(self, index: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """The kept keys [b, s, s]: each query's `topk` best-scored allowed keys (all where fewer are allowed)."""
        top = index.detach().topk(min(self.shape.topk, index.shape[-1]), dim=-1).indices
        return torch.zeros_like(blocked).scatter(-1, top, True) & ~blocked


def indexer_kl(index: torch.Tensor, attention: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2's sparse-stage indexer loss: per query, KL(p || q) over its kept keys, where p is the attention's
    probabilities summed over heads and normalised over those keys, and q the softmax of the indexer's scores over
    them; the mean over queries. `index` [b, s, s] (scores), `attention` [b, s, s] (summed probabilities, no
    gradient), `keep` [b, s, s] bool (every query keeps at least itself)."""
    target = attention.masked_fill(~keep, 0.0)
    target = target / target.sum(-1, keepdim=True)
    log_q = torch.log_softmax(index.float().masked_fill(~keep, float("-inf")), dim=-1)
    terms = torch.where(keep & (target > 0), target * (torch.log(target.clamp_min(1e-30)) - log_q),
                        torch.zeros_like(target))
    return terms.sum(-1).mean()


class DSACoreAttention(SDPACoreAttention):
    """rlx's SDPA core attention, masked to the indexer's selection (`Indexer.select`) within the causal mask."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any, *, dsa: DSAShape,
                 full: bool, selection: Selection, **kwargs: Any):
        super().__init__(config, layer_number, attn_mask_type, **kwargs)
        self.selection = selection
        self.kl_coef = float(getattr(config, "dsa_indexer_loss_coeff", None) or 0.0)
        self.indexer = Indexer(dsa, config, trained=self.kl_coef > 0) if full else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: BlockCausal | torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: object = None,
                x: torch.Tensor | None = None, qr: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        s, b = query.shape[:2]
        blocked = self.selection.blocked(attention_mask, b, s, query.device)
        index = None
        if self.indexer is not None:
            if x is None or qr is None:
                raise ValueError("DSACoreAttention needs megatron's MLA with experimental_attention_variant 'dsa' "
                                 "(the hidden states and the query latent)")
            learn = self.kl_coef > 0 and torch.is_grad_enabled() and self.training
            with torch.set_grad_enabled(learn):  # (the indexer's own inputs never pass its gradient back)
                index = self.indexer.scores(x.detach(), qr.detach(), blocked)
            self.selection.keep = self.indexer.select(index, blocked)
            index = index if learn else None
        keep = self.selection.keep
        if keep is None or keep.shape != (b, s, s):
            raise ValueError("a shared DSA layer ran before the full layer whose selection it reuses")
        out = super().forward(query, key, value, (blocked | ~keep)[:, None], attn_mask_type, attention_bias,
                              packed_seq_params)
        if index is None:
            return out
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

        loss = indexer_kl(index, self._attention(query, key, keep), keep) * self.kl_coef
        return DSAIndexerLossAutoScaler.apply(out, loss)  # (its gradient joins the backward pass, the output as is)

    @torch.no_grad()
    def _attention(self, query: torch.Tensor, key: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The attention's probabilities over the kept keys [b, s, s], summed over every head (this rank's, then
        all-reduced over tensor parallelism)."""
        q, k = query.permute(1, 2, 0, 3).float(), key.permute(1, 2, 0, 3).float()  # [b, heads, s, d]
        if k.size(1) != q.size(1):
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        logits = (q @ k.transpose(-1, -2) * self.softmax_scale).masked_fill(~keep[:, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).sum(1)
        if self.config.tensor_model_parallel_size > 1:
            from megatron.core import parallel_state

            torch.distributed.all_reduce(probs, group=parallel_state.get_tensor_model_parallel_group())
        return probs


@dataclass
class DSADecoderSpec(MLADecoderSpec):
    dsa: DSAShape | None = None

    def config_kwargs(self, parallel: ParallelConfig, dtype: torch.dtype) -> dict[str, Any]:
        # (megatron's MLA then hands the core attention the hidden states and the query latent)
        return {**super().config_kwargs(parallel, dtype), "experimental_attention_variant": "dsa"}

    def layer_spec(self, config: TransformerConfig, stage: Stage) -> ModuleSpec:
        from megatron.core.transformer.spec_utils import ModuleSpec

        shape = self.dsa
        assert shape is not None, "a DSA spec has its shape"
        if not shape.full[stage.layer_offset]:
            raise RLXError(f"train.parallel.pp: the pipeline stage starting at layer {stage.layer_offset} starts with "
                           f"a layer that reuses the previous layer's token selection (indexer_types 'shared'); "
                           f"stages must start at a 'full' layer")
        spec = super().layer_spec(config, stage)
        if self.moe is None:
            raise RLXError(f"{self.model_type}: sparse attention is built for the families that have experts")
        selection = Selection()  # one per stage's model: the full layers write it, the shared ones read it
        layers = []
        for i, layer in enumerate(spec.layer_specs):
            layer = copy.deepcopy(layer)
            layer.submodules.self_attention.submodules.core_attention = ModuleSpec(
                module=DSACoreAttention,
                params={"dsa": shape, "full": shape.full[stage.layer_offset + i], "selection": selection})
            layers.append(layer)
        spec.layer_specs = layers
        return spec

    def mtp_layer_spec(self, config: TransformerConfig, stage: Stage) -> ModuleSpec:
        """A full layer (its own indexer and selection) over the multi-token-prediction layer's sequence."""
        spec = copy.deepcopy(super().mtp_layer_spec(config, stage))
        core = spec.submodules.self_attention.submodules.core_attention
        core.params = {**core.params, "full": True, "selection": Selection()}
        return spec

    def attention_to_megatron(self, ckpt: HFCheckpoint, stage: Stage, h: str, m: str) -> Iterator[tuple[str, Any]]:
        yield from super().attention_to_megatron(ckpt, stage, h, m)
        if self._full(h):
            for name in INDEXER:
                yield f"{m}self_attention.core_attention.indexer.{name}", ckpt.get(f"{h}self_attn.indexer.{name}")

    def attention_to_hf(self, gather: Gather, h: str, m: str) -> Iterator[tuple[str, Any]]:
        yield from super().attention_to_hf(gather, h, m)
        if self._full(h):
            for name in INDEXER:
                yield f"{h}self_attn.indexer.{name}", gather(f"{m}self_attention.core_attention.indexer.{name}")[0]

    def _full(self, h: str) -> bool:
        assert self.dsa is not None, "a DSA spec has its shape"
        layer = int(h.rstrip(".").rsplit(".", 1)[1])
        return layer >= self.num_layers or self.dsa.full[layer]  # (multi-token-prediction layers are full)


INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def dsa_spec(c: HFConfig, moe_layers: Iterable[int], interleaved: bool, rotary: Any) -> DSADecoderSpec:
    """The spec of a DeepSeek-V3.2-shaped model from its HF config `c`: DeepSeek-V3's (`deepseek_v3_spec`) with
    sparse attention; `interleaved`: the indexer's rotary pairs (GLM-5) or halves (DeepSeek-V3.2); `rotary`: the
    family's transformers rotary embedding built from `c`. Layers are full unless ``indexer_types`` says
    ``shared``; the first must be full."""
    types = list(getattr(c, "indexer_types", None) or ["full"] * c.num_hidden_layers)
    unknown = sorted(set(types) - {"full", "shared"})
    if unknown or len(types) != c.num_hidden_layers or types[0] != "full":
        raise RLXError(f"model.path: a {c.model_type} checkpoint with indexer_types {types}: one of 'full' or "
                       f"'shared' per layer ({c.num_hidden_layers}), the first 'full'")
    base = deepseek_v3_spec(c, moe_layers)
    shape = DSAShape(heads=c.index_n_heads, head_dim=c.index_head_dim, topk=c.index_topk, rope=c.qk_rope_head_dim,
                     interleaved=interleaved, full=tuple(t == "full" for t in types), rotary=rotary)
    return DSADecoderSpec(**{f.name: getattr(base, f.name) for f in fields(base) if f.init}, dsa=shape)
