"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) as a `DecoderSpec`: `MLADecoderSpec` is rlx's
standard decoder with MLA in place of GQA attention, so a family built this way (``deepseek_v3`` in
``rlx-model-deepseek``, ``glm4_moe_lite`` in ``rlx-model-glm``) only reads its HF config.

MLA projects queries through a low-rank latent (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``, or one
``q_proj`` without it) and keys and values through a shared latent (``kv_a_proj_with_mqa`` gives the latent and
one rotary key shared by all heads; ``kv_a_layernorm`` -> ``kv_b_proj`` gives each head's key and value). Each
head's query and key are a part without position (``qk_nope_head_dim``) and a rotary part
(``qk_rope_head_dim``); values have their own size (``v_head_dim``).

Megatron names (local spec): ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` (or
``linear_q_proj``), ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj``, ``linear_proj``; the
layouts are HF's, row for row, except:

* Rotary dimensions. megatron's MLA de-interleaves the rotary part of each query and key (even dimensions, then
  odd) before rotating halves, which is what transformers does with ``rope_interleave: true`` (DeepSeek's
  checkpoints). With ``rope_interleave: false`` the rotary rows of ``q_b_proj`` (or ``q_proj``) and
  ``kv_a_proj_with_mqa`` are interleaved on the way in (and back on the way out), so megatron's
  de-interleaving restores HF's order.
* Tensor parallelism splits every projection by output rows: the up projections by heads, and the two down
  projections by rows of the latent (megatron's local spec uses column-parallel down projections and
  gathers their outputs), so the latent sizes must divide by ``tp``. ``linear_proj`` is row parallel.
* The latent norms use eps 1e-6 as transformers' do, whatever ``rms_norm_eps`` is (`LatentRMSNorm`), and are
  set in the layer spec with ``qk_layernorm`` off: with it on, megatron (0.16.1) sums the ``q_layernorm`` gradient
  over tensor-parallel ranks as for per-head q/k norms, but MLA's query norm sits on the gathered latent, before
  the column-parallel up projection, and its gradient is already whole on every rank (summing doubles it).

YaRN: transformers scales cos/sin by an attention factor and (with ``mscale_all_dim``) the softmax by
``mscale(factor, mscale_all_dim)²``; megatron computes both from ``mscale``/``mscale_all_dim``. `MLAShape.from_hf`
solves megatron's ``mscale`` so that both give transformers' numbers, also when the checkpoint states an
``attention_factor`` or only one of the two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from rlx.errors import RLXError
from rlx.train.balance import FlopsModel
from rlx.train.decoder import DecoderSpec, mean_ffn
from rlx.train.moe import MoEShape
from rlx.train.spec import Gather, HFCheckpoint, Stage, tp_chunk

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.autograd.function import FunctionCtx

    from rlx.config import ParallelConfig
    from rlx.types import HFConfig

LATENT_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAShape:
    """The latent attention of a family, with its rotary embedding (plain or YaRN) in megatron's terms."""

    q_lora: int | None  # query latent (None: one q_proj)
    kv_lora: int  # key/value latent
    nope: int  # per head, the query/key part without position
    rope: int  # per head, the rotary part (one key part shared by all heads)
    v: int  # per head, the value
    interleaved: bool = True  # HF's rope_interleave: the checkpoint's rotary rows are interleaved pairs
    rope_type: Literal["rope", "yarn"] = "rope"
    factor: float = 1.0
    original_max_positions: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0  # megatron's, solved so that cos/sin scale as transformers'
    mscale_all_dim: float = 0.0

    @classmethod
    def from_hf(cls, c: HFConfig) -> MLAShape:
        where = f"model.path: the {c.model_type} checkpoint"
        if getattr(c, "attention_bias", False):
            raise RLXError(f"{where} has attention_bias: true; megatron's latent attention has no projection biases")
        if c.num_key_value_heads != c.num_attention_heads:
            raise RLXError(f"{where} has num_key_value_heads {c.num_key_value_heads} != num_attention_heads "
                           f"{c.num_attention_heads}; latent attention gives every head its own key and value")
        rope = dict(getattr(c, "rope_parameters", None) or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise RLXError(f"{where}: rope_parameters.partial_rotary_factor is "
                           f"{rope['partial_rotary_factor']}; latent attention rotates all qk_rope_head_dim dims")
        base = dict(q_lora=c.q_lora_rank, kv_lora=c.kv_lora_rank, nope=c.qk_nope_head_dim, rope=c.qk_rope_head_dim,
                    v=c.v_head_dim, interleaved=bool(getattr(c, "rope_interleave", True)))
        if kind == "default":
            return cls(**base)
        if kind != "yarn":
            raise RLXError(f"{where}: rope_parameters.rope_type {kind!r}; latent attention takes 'default' or 'yarn'")
        if not rope.get("truncate", True):
            raise RLXError(f"{where}: rope_parameters.truncate: false; megatron's YaRN always rounds the "
                           f"correction range to whole dimensions")
        if "original_max_position_embeddings" not in rope:
            raise RLXError(f"{where}: rope_parameters has no original_max_position_embeddings, which YaRN needs")
        original = int(rope["original_max_position_embeddings"])
        factor = float(rope.get("factor") or c.max_position_embeddings / original)
        ms, mad = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = rope.get("attention_factor")
        if attention is None:
            attention = _mscale(factor, ms) / _mscale(factor, mad) if ms and mad else _mscale(factor)
        # transformers' softmax scale carries mscale(factor, mscale_all_dim)² (only when that is set); megatron's
        # carries mscale(factor, its mscale_all_dim)² and scales cos/sin by mscale(f, mscale) / mscale(f, mad)
        mad = float(mad or 0.0)
        if factor > 1:
            ms = (attention * _mscale(factor, mad) - 1.0) / (0.1 * math.log(factor))
        elif attention != 1.0:
            raise RLXError(f"{where}: YaRN with factor {factor} <= 1 and attention factor {attention}; megatron "
                           f"applies no attention factor there")
        else:
            ms = 1.0
        return cls(**base, rope_type="yarn", factor=factor, original_max_positions=original,
                   beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                   mscale=float(ms), mscale_all_dim=mad)

    @property
    def qk(self) -> int:
        return self.nope + self.rope

    def transformer_kwargs(self) -> dict[str, Any]:
        """megatron ``MLATransformerConfig`` arguments."""
        return dict(multi_latent_attention=True, q_lora_rank=self.q_lora, kv_lora_rank=self.kv_lora,
                    qk_head_dim=self.nope, qk_pos_emb_head_dim=self.rope, v_head_dim=self.v,
                    kv_channels=self.qk, qk_layernorm=False, rope_type=self.rope_type,
                    rotary_scaling_factor=self.factor, original_max_position_embeddings=self.original_max_positions,
                    beta_fast=self.beta_fast, beta_slow=self.beta_slow, mscale=self.mscale,
                    mscale_all_dim=self.mscale_all_dim)

    # -- rotary rows ------------------------------------------------------------------------------

    def _order(self) -> torch.Tensor:
        half = self.rope // 2
        return torch.stack([torch.arange(half), torch.arange(half) + half], 1).reshape(-1)

    def rope_rows(self, t: torch.Tensor, per_row: int, offset: int, inverse: bool = False) -> torch.Tensor:
        """`t` with the rotary rows of each group of `per_row` rows (those at ``offset:offset+rope``) moved
        between HF's order and megatron's (nothing to move for interleaved checkpoints)."""
        if self.interleaved:
            return t
        order = self._order()
        if inverse:
            order = torch.argsort(order)
        g = t.reshape(-1, per_row, *t.shape[1:]).clone()
        g[:, offset:offset + self.rope] = g[:, offset:offset + self.rope][:, order]
        return g.reshape(t.shape)


class LatentRMSNorm(torch.nn.RMSNorm):
    """The q/kv latent norms: eps 1e-6 as transformers' (megatron would pass the model's ``rms_norm_eps``)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float | None = None, **kwargs: Any):
        super().__init__(hidden_size, eps=LATENT_EPS, dtype=config.params_dtype)


@dataclass
class MLADecoderSpec(DecoderSpec):
    mla: MLAShape | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mla is None:
            raise TypeError("MLADecoderSpec needs mla (an MLAShape)")

    # -- megatron side ---------------------------------------------------------------------------

    def transformer_config(self, parallel: ParallelConfig, dtype: torch.dtype, **common: Any) -> TransformerConfig:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        s = self.mla
        assert s is not None
        for name, size in (("q_lora_rank", s.q_lora), ("kv_lora_rank + qk_rope_head_dim", s.kv_lora + s.rope)):
            if size is not None and size % parallel.tp:
                raise RLXError(f"train.parallel.tp: {parallel.tp} does not divide the {self.model_type} "
                               f"model's {name} ({size}); megatron splits the latent projections by rows")
        kw = {**self.config_kwargs(parallel, dtype), **s.transformer_kwargs(), "rotary_base": self.rope_theta}
        return MLATransformerConfig(**kw, **common)

    def layer_spec(self, config: TransformerConfig, stage: Stage) -> ModuleSpec:
        spec = super().layer_spec(config, stage)  # latent attention, as config.multi_latent_attention says; SDPA
        for layer in spec.layer_specs if self.moe is not None else [spec]:
            attention = layer.submodules.self_attention.submodules
            attention.q_layernorm = attention.kv_layernorm = LatentRMSNorm
        return spec

    def build(self, config: TransformerConfig, stage: Stage) -> torch.nn.Module:
        if config.sequence_parallel:  # the hook below hands megatron a whole output, which SP would cut again
            raise RLXError("latent attention (rlx.train.mla) does not support sequence parallelism")
        model = super().build(config, stage)
        if config.tensor_model_parallel_size > 1:
            from megatron.core.transformer.multi_latent_attention import MLASelfAttention

            for module in model.modules():
                if isinstance(module, MLASelfAttention):
                    module.linear_kv_down_proj.register_forward_hook(_whole_rotary_key)
        return model

    # -- weights ---------------------------------------------------------------------------------

    def attention_to_megatron(self, ckpt: HFCheckpoint, stage: Stage, h: str, m: str) -> Iterator[tuple[str, Any]]:
        s, r, tp = self.mla, stage.tp_rank, stage.tp
        assert s is not None
        a, x = h + "self_attn.", m + "self_attention."
        if s.q_lora is None:
            yield x + "linear_q_proj.weight", s.rope_rows(ckpt.shard(a + "q_proj.weight", 0, r, tp), s.qk, s.nope)
        else:
            yield x + "linear_q_down_proj.weight", ckpt.shard(a + "q_a_proj.weight", 0, r, tp)
            yield x + "q_layernorm.weight", ckpt.get(a + "q_a_layernorm.weight")
            yield x + "linear_q_up_proj.weight", s.rope_rows(ckpt.shard(a + "q_b_proj.weight", 0, r, tp), s.qk,
                                                             s.nope)
        kv = s.rope_rows(ckpt.get(a + "kv_a_proj_with_mqa.weight"), s.kv_lora + s.rope, s.kv_lora)
        yield x + "linear_kv_down_proj.weight", tp_chunk(kv, 0, r, tp)
        yield x + "kv_layernorm.weight", ckpt.get(a + "kv_a_layernorm.weight")
        yield x + "linear_kv_up_proj.weight", ckpt.shard(a + "kv_b_proj.weight", 0, r, tp)
        yield x + "linear_proj.weight", ckpt.shard(a + "o_proj.weight", 1, r, tp)

    def attention_to_hf(self, gather: Gather, h: str, m: str) -> Iterator[tuple[str, Any]]:
        s = self.mla
        assert s is not None
        a, x = h + "self_attn.", m + "self_attention."

        def rows(name: str) -> torch.Tensor:
            return torch.cat(gather(x + name), 0)

        if s.q_lora is None:
            yield a + "q_proj.weight", s.rope_rows(rows("linear_q_proj.weight"), s.qk, s.nope, inverse=True)
        else:
            yield a + "q_a_proj.weight", rows("linear_q_down_proj.weight")
            yield a + "q_a_layernorm.weight", gather(x + "q_layernorm.weight")[0]
            yield a + "q_b_proj.weight", s.rope_rows(rows("linear_q_up_proj.weight"), s.qk, s.nope, inverse=True)
        yield a + "kv_a_proj_with_mqa.weight", s.rope_rows(rows("linear_kv_down_proj.weight"), s.kv_lora + s.rope,
                                                           s.kv_lora, inverse=True)
        yield a + "kv_a_layernorm.weight", gather(x + "kv_layernorm.weight")[0]
        yield a + "kv_b_proj.weight", rows("linear_kv_up_proj.weight")
        yield a + "o_proj.weight", torch.cat(gather(x + "linear_proj.weight"), 1)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tensor-parallel group. (megatron's
    ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()`` and returns ``grad``: for the
    non-contiguous gradient of a slice the sum is lost.)"""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state

        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        return grad


def _whole_rotary_key(module: MegatronModule, args: tuple[Any, ...],
                      output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
    """A forward hook on ``linear_kv_down_proj`` under tensor parallelism (without sequence parallelism).

    megatron (0.16.1) gathers the column-parallel down projection's output over tensor-parallel ranks and splits it
    into the latent and the rotary key part shared by all heads. The latent's gradient comes back whole (the
    column-parallel up projection all-reduces it), but the rotary key's comes only from this rank's heads, and
    nothing sums it over ranks: every rank's down projection and everything before it get a wrong gradient. Here
    the hook does the gather itself and sums the rotary part's gradient over ranks; megatron then sees the whole
    output and does not gather again."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    local, bias = output
    config = module.config
    whole = gather_from_tensor_model_parallel_region(local)
    latent, rotary = whole.split([config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
    return torch.cat([latent, _SumGradOverTP.apply(rotary)], dim=-1), bias


def mla_flops(hidden: int, layers: int, ffn: int, vocab: int, heads: int, shape: MLAShape,
              experts: MoEShape | None = None) -> FlopsModel:
    """The FLOPs model of a latent-attention decoder (multiply-adds, as `FlopsModel.from_shape` counts them):
    per token the latent projections, each head's up projections and the output, the MLP's active width and
    the LM head; per (query, key) pair each head's query·key over ``nope + rope`` and weights·values over ``v``
    (half the pairs: causal)."""
    q = hidden * heads * shape.qk if shape.q_lora is None else shape.q_lora * (hidden + heads * shape.qk)
    kv = hidden * (shape.kv_lora + shape.rope) + shape.kv_lora * heads * (shape.nope + shape.v)
    attention = q + kv + heads * shape.v * hidden
    per_token = layers * (attention + 3 * hidden * mean_ffn(layers, ffn, experts)) + hidden * vocab
    per_pair = layers * heads * (shape.qk + shape.v) / 2
    return FlopsModel(float(per_token), float(per_pair))


def deepseek_v3_spec(c: HFConfig, moe_layers: Iterable[int]) -> MLADecoderSpec:
    """The spec of a DeepSeek-V3-shaped model (latent attention, DeepSeek's router, shared experts) from its HF
    config `c`; `moe_layers` are the layers with experts (the family says which)."""
    from rlx.train.moe import deepseek_router
    from rlx.train.spec import rope_theta

    mla = MLAShape.from_hf(c)
    experts = deepseek_router(c, frozenset(moe_layers))
    heads = c.num_attention_heads
    return MLADecoderSpec(
        model_type=c.model_type, hf_config=c, num_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
        hidden_size=c.hidden_size, max_positions=c.max_position_embeddings,
        tied=bool(getattr(c, "tie_word_embeddings", False)), rope_theta=rope_theta(c),
        flops=mla_flops(c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size, heads, mla, experts),
        heads=heads, kv_heads=heads, head_dim=mla.qk, ffn=c.intermediate_size, rms_eps=c.rms_norm_eps,
        moe=experts, mla=mla,
    )
