"""rlx model plugin for Qwen's mixture-of-experts families: ``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B and
their Coder variants).

Qwen3-MoE is the standard decoder (`rlx.train.decoder.DecoderSpec`: GQA with qk-norm, RMSNorm, RoPE) whose
MLPs are routed experts: a softmax router picks ``num_experts_per_tok`` of ``num_experts`` experts per token,
renormalising their weights when ``norm_topk_prob`` (megatron: top-k on the logits, then softmax over the k;
without it, softmax over all experts first). Layers listed in ``mlp_only_layers``, or off the
``decoder_sparse_step`` grid, are dense. There are no shared experts.

The load-balancing loss is off in training (``moe_aux_loss_coeff`` 0, as slime and Megatron default for RL);
its value is still logged each step (``moe/aux_loss``).
"""

from __future__ import annotations

from typing import Any

from rlx import hookimpl
from rlx.hookspecs import Register
from rlx.train.decoder import DecoderSpec, decoder_flops
from rlx.train.moe import MoEShape
from rlx.train.spec import ModelBridge, rope_theta


def moe_layers(c: Any) -> frozenset[int]:
    """Which layers have experts, as transformers' Qwen3MoeDecoderLayer decides."""
    step = getattr(c, "decoder_sparse_step", 1) or 1
    dense = set(getattr(c, "mlp_only_layers", None) or [])
    return frozenset(i for i in range(c.num_hidden_layers)
                     if i not in dense and c.num_experts > 0 and (i + 1) % step == 0)


class Qwen3MoeBridge:
    name = "qwen3-moe"
    model_types = ("qwen3_moe",)

    def spec(self, hf_config: Any) -> DecoderSpec:
        c = hf_config
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        shape = MoEShape(experts=c.num_experts, topk=c.num_experts_per_tok, ffn=c.moe_intermediate_size,
                         layers=moe_layers(c), pre_softmax=not c.norm_topk_prob)
        return DecoderSpec(
            model_type=c.model_type, hf_config=c, num_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
            hidden_size=c.hidden_size, max_positions=c.max_position_embeddings,
            tied=bool(getattr(c, "tie_word_embeddings", False)), rope_theta=rope_theta(c),
            flops=decoder_flops(c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size, kv_heads,
                                heads, shape),
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=c.intermediate_size, rms_eps=c.rms_norm_eps,
            qk_norm=True, qkv_bias=bool(getattr(c, "attention_bias", False)), moe=shape,
        )


@hookimpl
def register_models(register: Register[type[ModelBridge]]) -> None:
    from rlx_model_qwen.next import Qwen3NextBridge, Qwen35Bridge

    register(Qwen3MoeBridge)
    register(Qwen3NextBridge)
    register(Qwen35Bridge)
