"""HF checkpoints to Megatron GPTModel and back, for the Llama family (Llama, Qwen2, Qwen3).

Megatron's local (non Transformer Engine) layer spec is used, so names are the local ones:
``self_attention.linear_qkv``, ``mlp.linear_fc1`` and separate ``input_layernorm`` modules. A bridge
knows, for one HF architecture, the TransformerConfig to build and how each weight maps:

* q, k and v are fused into ``linear_qkv`` grouped by query group: ``[q heads of group g, k_g, v_g]``
  for each group, which is also the order tensor parallelism splits on (column parallel, dim 0).
* gate and up are fused into ``linear_fc1`` as ``[gate; up]`` per tensor-parallel rank.
* ``linear_proj`` and ``linear_fc2`` are row parallel (split on dim 1); embeddings and the output
  layer split the vocabulary (dim 0).
* With pipeline parallelism a stage holds layers ``offset .. offset + n - 1`` under local indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class ModelShape:
    """What rlx needs from an HF config, whatever the transformers version calls it."""

    model_type: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rms_eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    qk_norm: bool
    qkv_bias: bool

    @classmethod
    def from_hf(cls, c: Any) -> ModelShape:
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta or getattr(c, "rope_theta", None) or 10000.0
        heads = c.num_attention_heads
        return cls(
            model_type=c.model_type,
            vocab_size=c.vocab_size,
            hidden=c.hidden_size,
            layers=c.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            ffn=c.intermediate_size,
            rms_eps=c.rms_norm_eps,
            rope_theta=float(theta),
            max_positions=c.max_position_embeddings,
            tied=bool(getattr(c, "tie_word_embeddings", False)),
            qk_norm=c.model_type == "qwen3",
            qkv_bias=c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
        )


class LlamaBridge:
    """Bridge for Llama-style decoders: RMSNorm, RoPE, GQA, SwiGLU (+ qk-norm for Qwen3, qkv bias for Qwen2)."""

    name = "llama"
    model_types = ("llama", "qwen2", "qwen3", "mistral")

    def transformer_config(self, shape: ModelShape, *, tp: int, pp: int, dtype: torch.dtype, **extra: Any):
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
            num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
            normalization="RMSNorm", layernorm_epsilon=shape.rms_eps, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
            qk_layernorm=shape.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
            use_cpu_initialization=True, pipeline_dtype=dtype, **extra,
        )

    def layer_spec(self, shape: ModelShape):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")

    # -- HF -> Megatron --------------------------------------------------------------------------

    def to_megatron(self, hf: dict[str, torch.Tensor], shape: ModelShape, *, tp_rank: int, tp: int,
                    layer_offset: int, num_layers: int, first: bool, last: bool) -> dict[str, torch.Tensor]:
        """The Megatron state dict of one (TP rank, PP stage) from a full HF state dict."""
        import torch

        out: dict[str, torch.Tensor] = {}

        def chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
            return t.chunk(tp, dim=dim)[tp_rank].clone()

        if first:
            out["embedding.word_embeddings.weight"] = chunk(hf["model.embed_tokens.weight"], 0)
        if last:
            out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
            if not shape.tied:
                out["output_layer.weight"] = chunk(hf["lm_head.weight"], 0)
            elif not first:  # the last stage keeps its own copy of the tied embedding
                out["output_layer.weight"] = chunk(hf["model.embed_tokens.weight"], 0)
        for local in range(num_layers):
            h, m = f"model.layers.{layer_offset + local}.", f"decoder.layers.{local}."
            out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
            out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
            out[m + "self_attention.linear_qkv.weight"] = chunk(self._fuse_qkv(hf, h, shape, "weight"), 0)
            if shape.qkv_bias:
                out[m + "self_attention.linear_qkv.bias"] = chunk(self._fuse_qkv(hf, h, shape, "bias"), 0)
            if shape.qk_norm:
                out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"].clone()
                out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"].clone()
            out[m + "self_attention.linear_proj.weight"] = chunk(hf[h + "self_attn.o_proj.weight"], 1)
            gate = chunk(hf[h + "mlp.gate_proj.weight"], 0)
            up = chunk(hf[h + "mlp.up_proj.weight"], 0)
            out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
            out[m + "mlp.linear_fc2.weight"] = chunk(hf[h + "mlp.down_proj.weight"], 1)
        return out

    def _fuse_qkv(self, hf: dict[str, torch.Tensor], h: str, s: ModelShape, kind: str) -> torch.Tensor:
        import torch

        q = hf[h + f"self_attn.q_proj.{kind}"]
        k = hf[h + f"self_attn.k_proj.{kind}"]
        v = hf[h + f"self_attn.v_proj.{kind}"]
        per = s.heads // s.kv_heads
        q = q.reshape(s.kv_heads, per * s.head_dim, *q.shape[1:])
        k = k.reshape(s.kv_heads, s.head_dim, *k.shape[1:])
        v = v.reshape(s.kv_heads, s.head_dim, *v.shape[1:])
        return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])

    # -- Megatron -> HF --------------------------------------------------------------------------

    def to_hf(self, shards: list[dict[str, torch.Tensor]], shape: ModelShape, *, layer_offset: int,
              num_layers: int, first: bool, last: bool) -> dict[str, torch.Tensor]:
        """HF tensors of one PP stage from the state dicts of all its TP ranks (in rank order)."""
        import torch

        out: dict[str, torch.Tensor] = {}

        def cat(name: str, dim: int) -> torch.Tensor:
            return torch.cat([s[name] for s in shards], dim=dim)

        if first:
            out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)
        if last:
            out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
            if not shape.tied:
                out["lm_head.weight"] = cat("output_layer.weight", 0)
            elif not first:
                out["model.embed_tokens.weight"] = cat("output_layer.weight", 0)
        for local in range(num_layers):
            h, m = f"model.layers.{layer_offset + local}.", f"decoder.layers.{local}."
            out[h + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"].clone()
            out[h + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"].clone()
            self._split_qkv(cat(m + "self_attention.linear_qkv.weight", 0), h, shape, "weight", out)
            if shape.qkv_bias:
                self._split_qkv(cat(m + "self_attention.linear_qkv.bias", 0), h, shape, "bias", out)
            if shape.qk_norm:
                out[h + "self_attn.q_norm.weight"] = shards[0][m + "self_attention.q_layernorm.weight"].clone()
                out[h + "self_attn.k_norm.weight"] = shards[0][m + "self_attention.k_layernorm.weight"].clone()
            out[h + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
            gates, ups = zip(*(s[m + "mlp.linear_fc1.weight"].chunk(2, 0) for s in shards), strict=True)
            out[h + "mlp.gate_proj.weight"] = torch.cat(gates, 0)
            out[h + "mlp.up_proj.weight"] = torch.cat(ups, 0)
            out[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
        return out

    def _split_qkv(self, fused: torch.Tensor, h: str, s: ModelShape, kind: str, out: dict) -> None:
        per = s.heads // s.kv_heads
        g = fused.reshape(s.kv_heads, (per + 2) * s.head_dim, *fused.shape[1:])
        q, k, v = g.split([per * s.head_dim, s.head_dim, s.head_dim], dim=1)
        out[h + f"self_attn.q_proj.{kind}"] = q.reshape(-1, *fused.shape[1:]).contiguous()
        out[h + f"self_attn.k_proj.{kind}"] = k.reshape(-1, *fused.shape[1:]).contiguous()
        out[h + f"self_attn.v_proj.{kind}"] = v.reshape(-1, *fused.shape[1:]).contiguous()

