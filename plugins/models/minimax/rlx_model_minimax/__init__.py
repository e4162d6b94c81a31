"""rlx model plugin for MiniMax-M2 (``minimax_m2``: MiniMax-M2, M2.1 and M2.5 of the same architecture).

MiniMax-M2 is rlx's standard decoder (`rlx.train.decoder.DecoderSpec`) with

* GQA attention whose q and k norms each span all of a token's heads (``q_norm`` over ``heads * head_dim``, not per
  head as Qwen3's): `FullWidthRMSNorm`, whose weights tensor parallelism splits by heads, the sum of squares
  all-reduced over the group (SGLang's ``MiniMaxM2RMSNormTP`` does the same);
* rotary embedding on the first ``rotary_dim`` of each head (rotate-half: megatron's ``rotary_percent``);
* routed experts in every layer, no shared experts: sigmoid scores, a per-expert correction bias for selection only
  (``block_sparse_moe.e_score_correction_bias``, megatron's expert bias, moved by aux-loss-free balancing after each
  optimizer step), top-k, weights renormalised. Experts are Mixtral-named (``experts.{e}.w1`` gate, ``w3`` up,
  ``w2`` down).

Not covered: the multi-token-prediction modules MiniMax's checkpoints may carry (``num_mtp_modules``) are neither
trained nor pushed (transformers does not build them either).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlx import hookimpl
from rlx.errors import RLXError
from rlx.hookspecs import Register
from rlx.train import moe
from rlx.train.decoder import DecoderSpec, decoder_flops
from rlx.train.spec import Gather, HFCheckpoint, ModelBridge, Stage, fuse_qkv, rope_theta, split_qkv

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


@dataclass
class MiniMaxM2Spec(DecoderSpec):
    def config_kwargs(self, parallel: Any, dtype: Any) -> dict[str, Any]:
        # megatron sums the gradients of every q/k layernorm over tensor-parallel ranks when qk_layernorm is set (its
        # per-head norms are replicated there); these are split by heads, so the flag stays off (the norms are in the
        # layer spec all the same)
        return {**super().config_kwargs(parallel, dtype), "qk_layernorm": False}

    def layer_spec(self, config: Any, stage: Stage) -> Any:
        from rlx_model_minimax.norm import FullWidthKNorm, FullWidthQNorm

        spec = super().layer_spec(config, stage)
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.q_layernorm = FullWidthQNorm
            layer.submodules.self_attention.submodules.k_layernorm = FullWidthKNorm
        return spec

    def attention_to_megatron(self, ckpt: HFCheckpoint, stage: Stage, h: str, m: str) -> Iterator[tuple[str, Any]]:
        r, tp = stage.tp_rank, stage.tp
        q, k, v = (ckpt.shard(h + f"self_attn.{p}_proj.weight", 0, r, tp) for p in "qkv")
        yield m + "self_attention.linear_qkv.weight", fuse_qkv(q, k, v, self.heads // tp, self.kv_heads // tp,
                                                               self.head_dim)
        yield m + "self_attention.q_layernorm.weight", ckpt.shard(h + "self_attn.q_norm.weight", 0, r, tp)
        yield m + "self_attention.k_layernorm.weight", ckpt.shard(h + "self_attn.k_norm.weight", 0, r, tp)
        yield m + "self_attention.linear_proj.weight", ckpt.shard(h + "self_attn.o_proj.weight", 1, r, tp)

    def attention_to_hf(self, gather: Gather, h: str, m: str) -> Iterator[tuple[str, Any]]:
        import torch

        q, k, v = split_qkv(torch.cat(gather(m + "self_attention.linear_qkv.weight"), 0), self.heads, self.kv_heads,
                            self.head_dim)
        yield h + "self_attn.q_proj.weight", q
        yield h + "self_attn.k_proj.weight", k
        yield h + "self_attn.v_proj.weight", v
        yield h + "self_attn.q_norm.weight", torch.cat(gather(m + "self_attention.q_layernorm.weight"), 0)
        yield h + "self_attn.k_norm.weight", torch.cat(gather(m + "self_attention.k_layernorm.weight"), 0)
        yield h + "self_attn.o_proj.weight", torch.cat(gather(m + "self_attention.linear_proj.weight"), 1)

    def mlp_to_megatron(self, ckpt: HFCheckpoint, stage: Stage, layer: int, h: str,
                        m: str) -> Iterator[tuple[str, Any]]:
        yield m + "mlp.router.weight", ckpt.get(h + "block_sparse_moe.gate.weight")
        yield m + "mlp.router.expert_bias", ckpt.get(h + "block_sparse_moe.e_score_correction_bias")
        assert self.moe is not None, "every MiniMax-M2 layer has experts"
        yield from moe.experts_to_megatron(ckpt, stage, h + "block_sparse_moe.experts.", m + "mlp.experts.",
                                           self.moe.experts, EXPERT_NAMES)

    def mlp_to_hf(self, stage: Stage, gather: Gather, layer: int, h: str, m: str) -> Iterator[tuple[str, Any]]:
        yield h + "block_sparse_moe.gate.weight", gather(m + "mlp.router.weight")[0]
        yield h + "block_sparse_moe.e_score_correction_bias", gather(m + "mlp.router.expert_bias")[0]
        assert self.moe is not None, "every MiniMax-M2 layer has experts"
        yield from moe.experts_to_hf(stage, gather, h + "block_sparse_moe.experts.", m + "mlp.experts.",
                                     self.moe.experts, EXPERT_NAMES)


def rotary_fraction(c: Any) -> float:
    rope = getattr(c, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor") or (getattr(c, "rotary_dim", None) or c.head_dim) / c.head_dim)


class MiniMaxM2Bridge:
    name = "minimax-m2"
    model_types = ("minimax_m2",)

    def spec(self, hf_config: Any) -> MiniMaxM2Spec:
        c = hf_config
        if getattr(c, "use_qk_norm", True) is False or getattr(c, "qk_norm_type", "per_layer") != "per_layer":
            raise RLXError(f"model.path: a minimax_m2 checkpoint with use_qk_norm {getattr(c, 'use_qk_norm', None)} "
                           f"and qk_norm_type {getattr(c, 'qk_norm_type', None)!r}: the bridge implements the "
                           f"published one (use_qk_norm true, qk_norm_type per_layer), as transformers does")
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        shape = moe.MoEShape(experts=c.num_local_experts, topk=c.num_experts_per_tok, ffn=c.intermediate_size,
                             layers=frozenset(range(c.num_hidden_layers)), score="sigmoid", expert_bias=True)
        return MiniMaxM2Spec(
            model_type=c.model_type, hf_config=c, num_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
            hidden_size=c.hidden_size, max_positions=c.max_position_embeddings,
            tied=bool(getattr(c, "tie_word_embeddings", False)), rope_theta=rope_theta(c),
            rotary_percent=rotary_fraction(c),
            flops=decoder_flops(c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size, kv_heads,
                                heads, shape),
            heads=heads, kv_heads=kv_heads, head_dim=c.head_dim, ffn=c.intermediate_size, rms_eps=c.rms_norm_eps,
            qk_norm=True, moe=shape,
        )


@hookimpl
def register_models(register: Register[type[ModelBridge]]) -> None:
    register(MiniMaxM2Bridge)
