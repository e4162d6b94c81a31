"""Built-in model bridge: the Llama family (Llama, Qwen2, Qwen3, Mistral) on megatron-core's GPTModel.

An ordinary plugin using only the public bridge API (`rlx.train.spec`), as third-party model plugins
do. Megatron's local (non Transformer Engine) layer spec is used, so names are the local ones:
``self_attention.linear_qkv``, ``mlp.linear_fc1`` and separate ``input_layernorm`` modules.

* q, k and v are fused into ``linear_qkv`` grouped by query group (`fuse_qkv`), which is also the order
  tensor parallelism splits on: each rank reads its contiguous chunk of q, k and v and fuses those.
* gate and up are fused into ``linear_fc1`` as ``[gate; up]`` per tensor-parallel rank.
* ``linear_proj`` and ``linear_fc2`` are row parallel (split on dim 1); embeddings and the output
  layer split the vocabulary (dim 0).
* A tied embedding is kept by the last pipeline stage as its own output layer when it is not also
  the first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlx import hookimpl
from rlx.train.balance import FlopsModel
from rlx.train.spec import Gather, HFCheckpoint, ModelSpec, Stage, fuse_qkv, rope_theta, split_qkv


@dataclass
class LlamaSpec(ModelSpec):
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    ffn: int = 0
    rms_eps: float = 1e-6
    qk_norm: bool = False
    qkv_bias: bool = False

    def transformer_config(self, parallel: Any, dtype: Any, **common: Any) -> Any:
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=self.heads,
            num_query_groups=self.kv_heads, kv_channels=self.head_dim, ffn_hidden_size=self.ffn,
            normalization="RMSNorm", layernorm_epsilon=self.rms_eps, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
            params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
            use_cpu_initialization=True, pipeline_dtype=dtype, **common,
        )

    def layer_spec(self, config: Any, stage: Stage) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(qk_layernorm=self.qk_norm, normalization="RMSNorm")

    # -- HF -> megatron --------------------------------------------------------------------------

    def to_megatron(self, ckpt: HFCheckpoint, stage: Stage) -> Iterator[tuple[str, Any]]:
        import torch

        r, tp = stage.tp_rank, stage.tp

        def shard(name: str, dim: int) -> Any:
            return ckpt.shard(name, dim, r, tp)

        if stage.first:
            yield "embedding.word_embeddings.weight", shard("model.embed_tokens.weight", 0)
        for local, layer in enumerate(stage.layers()):
            h, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
            yield m + "input_layernorm.weight", ckpt.get(h + "input_layernorm.weight")
            kinds = ("weight", "bias") if self.qkv_bias else ("weight",)
            for kind in kinds:
                q, k, v = (shard(h + f"self_attn.{p}_proj.{kind}", 0) for p in "qkv")
                yield (m + f"self_attention.linear_qkv.{kind}",
                       fuse_qkv(q, k, v, self.heads // tp, self.kv_heads // tp, self.head_dim))
            if self.qk_norm:
                yield m + "self_attention.q_layernorm.weight", ckpt.get(h + "self_attn.q_norm.weight")
                yield m + "self_attention.k_layernorm.weight", ckpt.get(h + "self_attn.k_norm.weight")
            yield m + "self_attention.linear_proj.weight", shard(h + "self_attn.o_proj.weight", 1)
            yield m + "pre_mlp_layernorm.weight", ckpt.get(h + "post_attention_layernorm.weight")
            yield m + "mlp.linear_fc1.weight", torch.cat([shard(h + "mlp.gate_proj.weight", 0),
                                                           shard(h + "mlp.up_proj.weight", 0)], 0)
            yield m + "mlp.linear_fc2.weight", shard(h + "mlp.down_proj.weight", 1)
        if stage.last:
            yield "decoder.final_layernorm.weight", ckpt.get("model.norm.weight")
            if not self.tied:
                yield "output_layer.weight", shard("lm_head.weight", 0)
            elif not stage.first:  # the last stage keeps its own copy of the tied embedding
                yield "output_layer.weight", shard("model.embed_tokens.weight", 0)

    # -- megatron -> HF --------------------------------------------------------------------------

    def to_hf(self, stage: Stage, gather: Gather) -> Iterator[tuple[str, Any]]:
        import torch

        def cat(name: str, dim: int) -> Any:
            return torch.cat(gather(name), dim=dim)

        if stage.first:
            yield "model.embed_tokens.weight", cat("embedding.word_embeddings.weight", 0)
        for local, layer in enumerate(stage.layers()):
            h, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
            yield h + "input_layernorm.weight", gather(m + "input_layernorm.weight")[0]
            kinds = ("weight", "bias") if self.qkv_bias else ("weight",)
            for kind in kinds:
                q, k, v = split_qkv(cat(m + f"self_attention.linear_qkv.{kind}", 0), self.heads, self.kv_heads,
                                    self.head_dim)
                yield h + f"self_attn.q_proj.{kind}", q
                yield h + f"self_attn.k_proj.{kind}", k
                yield h + f"self_attn.v_proj.{kind}", v
            if self.qk_norm:
                yield h + "self_attn.q_norm.weight", gather(m + "self_attention.q_layernorm.weight")[0]
                yield h + "self_attn.k_norm.weight", gather(m + "self_attention.k_layernorm.weight")[0]
            yield h + "self_attn.o_proj.weight", cat(m + "self_attention.linear_proj.weight", 1)
            yield h + "post_attention_layernorm.weight", gather(m + "pre_mlp_layernorm.weight")[0]
            gates, ups = zip(*(s.chunk(2, 0) for s in gather(m + "mlp.linear_fc1.weight")), strict=True)
            yield h + "mlp.gate_proj.weight", torch.cat(gates, 0)
            yield h + "mlp.up_proj.weight", torch.cat(ups, 0)
            yield h + "mlp.down_proj.weight", cat(m + "mlp.linear_fc2.weight", 1)
        if stage.last:
            yield "model.norm.weight", gather("decoder.final_layernorm.weight")[0]
            if not self.tied:
                yield "lm_head.weight", cat("output_layer.weight", 0)
            elif not stage.first:
                yield "model.embed_tokens.weight", cat("output_layer.weight", 0)


class LlamaBridge:
    """Llama-style decoders: RMSNorm, RoPE, GQA, SwiGLU (+ qk-norm for Qwen3, qkv bias for Qwen2)."""

    name = "llama"
    model_types = ("llama", "qwen2", "qwen3", "mistral")

    def spec(self, hf_config: Any) -> LlamaSpec:
        c = hf_config
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return LlamaSpec(
            model_type=c.model_type, hf_config=c, num_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
            hidden_size=c.hidden_size, max_positions=c.max_position_embeddings,
            tied=bool(getattr(c, "tie_word_embeddings", False)), rope_theta=rope_theta(c),
            flops=FlopsModel.from_shape(c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size,
                                        kv_heads, heads),
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=c.intermediate_size, rms_eps=c.rms_norm_eps,
            qk_norm=c.model_type == "qwen3",
            qkv_bias=c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
        )


@hookimpl
def register_models(register):
    register(LlamaBridge)
