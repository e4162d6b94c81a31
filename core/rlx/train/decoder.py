"""The standard decoder as a public `ModelSpec`: GQA attention with RoPE, and per layer either a gated MLP or a
mixture of experts. Bridges of families built this way (Llama, Qwen2/3, Mistral in core; Qwen3-MoE, GLM-4.5 in
plugins) fill a `DecoderSpec` from their HF config and inherit its conversions; a family that differs in one
part overrides that part's pair of methods (`attention_to_megatron`/`attention_to_hf`, `mlp_to_megatron`/
`mlp_to_hf`).

Megatron's local (non Transformer Engine) specs are used, so names are the local ones:
``self_attention.linear_qkv``, ``mlp.linear_fc1``, ``mlp.router``, ``mlp.experts.local_experts.{j}`` and
separate ``input_layernorm``/``pre_mlp_layernorm`` modules.

* q, k and v are fused into ``linear_qkv`` by query group (`fuse_qkv`), also the order tensor parallelism
  splits on: each rank reads its contiguous chunk of q, k and v and fuses those.
* gate and up are fused into ``linear_fc1`` as ``[gate; up]`` per tensor-parallel rank (dense MLP, shared
  experts and each routed expert, the latter split over expert-tensor-parallel ranks).
* Experts: expert-parallel rank r holds experts ``[r*E/ep, (r+1)*E/ep)`` as its local experts 0..E/ep-1
  (`rlx.train.moe`). The router is replicated.
* ``linear_proj`` and ``linear_fc2`` are row parallel (split on dim 1); embeddings and the output layer split
  the vocabulary (dim 0). A tied embedding is kept by the last pipeline stage as its own output layer when it
  is not also the first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlx.train import moe
from rlx.train.balance import FlopsModel
from rlx.train.spec import Gather, HFCheckpoint, ModelSpec, Stage, fuse_qkv, split_qkv

if TYPE_CHECKING:
    import torch
    from megatron.core.transformer.spec_utils import ModuleSpec  # megatron ships no types: Any to a checker
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rlx.config import ParallelConfig


@dataclass
class DecoderSpec(ModelSpec):
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    ffn: int = 0  # dense MLP width
    rms_eps: float = 1e-6
    qk_norm: bool = False
    qkv_bias: bool = False
    moe: moe.MoEShape | None = None  # experts, when the model has any
    hf_router: str = "mlp.gate"  # the router's HF module under a layer
    hf_shared: str = "mlp.shared_experts"  # the shared experts' HF module under a layer
    hf_shared_gate: str = "mlp.shared_expert_gate"  # their gate's HF module (`MoEShape.shared_gate`)

    def __post_init__(self) -> None:
        if self.moe is not None:
            self.num_experts = self.moe.experts

    def is_moe_layer(self, layer: int) -> bool:
        """(A multi-token-prediction layer, after the last, is one in a model with experts, as published.)"""
        return self.moe is not None and (layer in self.moe.layers or layer >= self.num_layers)

    # -- megatron side ---------------------------------------------------------------------------

    def transformer_config(self, parallel: ParallelConfig, dtype: torch.dtype, **common: Any) -> TransformerConfig:
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(**self.config_kwargs(parallel, dtype), **common)

    def config_kwargs(self, parallel: ParallelConfig, dtype: torch.dtype) -> dict[str, Any]:
        """megatron ``TransformerConfig`` arguments of this decoder (a family that needs another config class
        adds its own to these)."""
        import torch

        experts = self.moe.transformer_kwargs(self.num_layers, parallel) if self.moe else {}
        return dict(
            num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=self.heads,
            num_query_groups=self.kv_heads, kv_channels=self.head_dim, ffn_hidden_size=self.ffn,
            normalization="RMSNorm", layernorm_epsilon=self.rms_eps, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
            params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
            use_cpu_initialization=True, pipeline_dtype=dtype, **experts,
        )

    def layer_spec(self, config: TransformerConfig, stage: Stage) -> ModuleSpec:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

        from rlx.train.attention import SDPACoreAttention

        if self.moe is None:
            spec = get_gpt_layer_local_spec(qk_layernorm=self.qk_norm, normalization="RMSNorm",
                                            multi_latent_attention=config.multi_latent_attention)
        else:
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                              pp_rank=stage.layer_offset // max(stage.num_layers, 1))
        for layer in spec.layer_specs if self.moe is not None else [spec]:  # packed rows without [L, L] masks
            layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        return spec

    def mtp_layer_spec(self, config: TransformerConfig, stage: Stage) -> ModuleSpec:
        """The last layer's spec (one with experts when the model has them: DeepSeek's and GLM's MTP layers are)."""
        spec = self.layer_spec(config, stage)
        return spec.layer_specs[-1] if self.moe is not None else spec

    # -- HF -> megatron --------------------------------------------------------------------------

    def to_megatron(self, ckpt: HFCheckpoint, stage: Stage) -> Iterator[tuple[str, Any]]:
        r, tp = stage.tp_rank, stage.tp
        if stage.first:
            yield "embedding.word_embeddings.weight", ckpt.shard("model.embed_tokens.weight", 0, r, tp)
        for local, layer in enumerate(stage.layers()):
            yield from self.layer_to_megatron(ckpt, stage, layer, f"model.layers.{layer}.", f"decoder.layers.{local}.")
        if stage.last:
            yield "decoder.final_layernorm.weight", ckpt.get("model.norm.weight")
            if not self.tied:
                yield "output_layer.weight", ckpt.shard("lm_head.weight", 0, r, tp)
            elif not stage.first:  # the last stage keeps its own copy of the tied embedding
                yield "output_layer.weight", ckpt.shard("model.embed_tokens.weight", 0, r, tp)
        for k in range(stage.mtp):  # (`rlx.train.mtp`); its embedding and output layer are the model's
            h, m = f"model.layers.{self.num_layers + k}.", f"mtp.layers.{k}."
            for norm in ("enorm", "hnorm"):
                yield m + f"{norm}.weight", ckpt.get(h + f"{norm}.weight")
            yield m + "eh_proj.weight", ckpt.shard(h + "eh_proj.weight", 0, r, tp)
            yield m + "final_layernorm.weight", ckpt.get(h + "shared_head.norm.weight")
            yield from self.layer_to_megatron(ckpt, stage, self.num_layers + k, h, m + "transformer_layer.")

    def layer_to_megatron(self, ckpt: HFCheckpoint, stage: Stage, layer: int, h: str,
                          m: str) -> Iterator[tuple[str, Any]]:
        yield m + "input_layernorm.weight", ckpt.get(h + "input_layernorm.weight")
        yield from self.attention_to_megatron(ckpt, stage, h, m)
        yield m + "pre_mlp_layernorm.weight", ckpt.get(h + "post_attention_layernorm.weight")
        yield from self.mlp_to_megatron(ckpt, stage, layer, h, m)

    def attention_to_megatron(self, ckpt: HFCheckpoint, stage: Stage, h: str, m: str) -> Iterator[tuple[str, Any]]:
        r, tp = stage.tp_rank, stage.tp
        for kind in ("weight", "bias") if self.qkv_bias else ("weight",):
            q, k, v = (ckpt.shard(h + f"self_attn.{p}_proj.{kind}", 0, r, tp) for p in "qkv")
            yield (m + f"self_attention.linear_qkv.{kind}",
                   fuse_qkv(q, k, v, self.heads // tp, self.kv_heads // tp, self.head_dim))
        if self.qk_norm:
            yield m + "self_attention.q_layernorm.weight", ckpt.get(h + "self_attn.q_norm.weight")
            yield m + "self_attention.k_layernorm.weight", ckpt.get(h + "self_attn.k_norm.weight")
        yield m + "self_attention.linear_proj.weight", ckpt.shard(h + "self_attn.o_proj.weight", 1, r, tp)

    def mlp_to_megatron(self, ckpt: HFCheckpoint, stage: Stage, layer: int, h: str,
                        m: str) -> Iterator[tuple[str, Any]]:
        if self.moe is None or not self.is_moe_layer(layer):
            yield from moe.gated_mlp_to_megatron(ckpt, h + "mlp.", m + "mlp.", stage.tp_rank, stage.tp)
            return
        yield from moe.router_to_megatron(ckpt, h + self.hf_router + ".", m + "mlp.router.", self.moe)
        yield from moe.experts_to_megatron(ckpt, stage, h + "mlp.experts.", m + "mlp.experts.", self.moe.experts)
        if self.moe.shared_ffn:
            yield from moe.gated_mlp_to_megatron(ckpt, h + self.hf_shared + ".", m + "mlp.shared_experts.",
                                                 stage.tp_rank, stage.tp)
        if self.moe.shared_gate:
            yield m + "mlp.shared_experts.gate_weight", ckpt.get(h + self.hf_shared_gate + ".weight")

    # -- megatron -> HF --------------------------------------------------------------------------

    def to_hf(self, stage: Stage, gather: Gather) -> Iterator[tuple[str, Any]]:
        import torch

        if stage.first:
            yield "model.embed_tokens.weight", torch.cat(gather("embedding.word_embeddings.weight"), 0)
        for local, layer in enumerate(stage.layers()):
            yield from self.layer_to_hf(stage, gather, layer, f"model.layers.{layer}.", f"decoder.layers.{local}.")
        if stage.last:
            yield "model.norm.weight", gather("decoder.final_layernorm.weight")[0]
            if not self.tied:
                yield "lm_head.weight", torch.cat(gather("output_layer.weight"), 0)
            elif not stage.first:
                yield "model.embed_tokens.weight", torch.cat(gather("output_layer.weight"), 0)
        for k in range(stage.mtp):
            h, m = f"model.layers.{self.num_layers + k}.", f"mtp.layers.{k}."
            for norm in ("enorm", "hnorm"):
                yield h + f"{norm}.weight", gather(m + f"{norm}.weight")[0]
            yield h + "eh_proj.weight", torch.cat(gather(m + "eh_proj.weight"), 0)
            yield h + "shared_head.norm.weight", gather(m + "final_layernorm.weight")[0]
            yield from self.layer_to_hf(stage, gather, self.num_layers + k, h, m + "transformer_layer.")
            # the checkpoint's own copies of the embedding and output layer the MTP layers share with the model
            embedding = torch.cat(gather("embedding.word_embeddings.weight"), 0)
            yield h + "embed_tokens.weight", embedding
            yield h + "shared_head.head.weight", embedding if self.tied else torch.cat(gather("output_layer.weight"), 0)

    def layer_to_hf(self, stage: Stage, gather: Gather, layer: int, h: str, m: str) -> Iterator[tuple[str, Any]]:
        yield h + "input_layernorm.weight", gather(m + "input_layernorm.weight")[0]
        yield from self.attention_to_hf(gather, h, m)
        yield h + "post_attention_layernorm.weight", gather(m + "pre_mlp_layernorm.weight")[0]
        yield from self.mlp_to_hf(stage, gather, layer, h, m)

    def attention_to_hf(self, gather: Gather, h: str, m: str) -> Iterator[tuple[str, Any]]:
        import torch

        for kind in ("weight", "bias") if self.qkv_bias else ("weight",):
            fused = torch.cat(gather(m + f"self_attention.linear_qkv.{kind}"), 0)
            q, k, v = split_qkv(fused, self.heads, self.kv_heads, self.head_dim)
            yield h + f"self_attn.q_proj.{kind}", q
            yield h + f"self_attn.k_proj.{kind}", k
            yield h + f"self_attn.v_proj.{kind}", v
        if self.qk_norm:
            yield h + "self_attn.q_norm.weight", gather(m + "self_attention.q_layernorm.weight")[0]
            yield h + "self_attn.k_norm.weight", gather(m + "self_attention.k_layernorm.weight")[0]
        yield h + "self_attn.o_proj.weight", torch.cat(gather(m + "self_attention.linear_proj.weight"), 1)

    def mlp_to_hf(self, stage: Stage, gather: Gather, layer: int, h: str, m: str) -> Iterator[tuple[str, Any]]:
        if self.moe is None or not self.is_moe_layer(layer):
            yield from moe.gated_mlp_to_hf(gather, h + "mlp.", m + "mlp.")
            return
        yield from moe.router_to_hf(gather, h + self.hf_router + ".", m + "mlp.router.", self.moe)
        yield from moe.experts_to_hf(stage, gather, h + "mlp.experts.", m + "mlp.experts.", self.moe.experts)
        if self.moe.shared_ffn:
            yield from moe.gated_mlp_to_hf(gather, h + self.hf_shared + ".", m + "mlp.shared_experts.")
        if self.moe.shared_gate:
            yield h + self.hf_shared_gate + ".weight", gather(m + "mlp.shared_experts.gate_weight")[0]


def mean_ffn(layers: int, ffn: int, shape: moe.MoEShape | None = None) -> float:
    """The MLP width a token passes through, averaged over layers: each MoE layer counts its active experts
    (top-k routed plus shared), not all of them."""
    if shape is None:
        return float(ffn)
    n_moe = len(shape.layers)
    return ((layers - n_moe) * ffn + n_moe * (shape.topk * shape.ffn + shape.shared_ffn)) / layers


def decoder_flops(hidden: int, layers: int, ffn: int, vocab: int, kv_heads: int, heads: int,
                  shape: moe.MoEShape | None = None) -> FlopsModel:
    """The FLOPs model of a decoder: with experts, each MoE layer costs its active experts, not all of them."""
    return FlopsModel.from_shape(hidden, layers, mean_ffn(layers, ffn, shape), vocab, kv_heads,  # type: ignore[arg-type]
                                 heads)
