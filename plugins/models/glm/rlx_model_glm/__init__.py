"""rlx model plugin for GLM's mixture-of-experts families: ``glm4_moe`` (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7)
and ``glm4_moe_lite`` (GLM-4.7-Flash).

GLM-4.5 is rlx's standard decoder (`rlx.train.decoder.DecoderSpec`) with:

* GQA attention with a q/k/v bias (``attention_bias``), optional qk-norm (``use_qk_norm``), and rotary embedding
  on the first ``partial_rotary_factor`` of each head (rotate-half, not interleaved: megatron's
  ``rotary_percent``);
* dense MLPs in the first ``first_k_dense_replace`` layers, then routed experts with ``n_shared_experts`` shared
  experts beside them;
* DeepSeek-V3's router: sigmoid scores plus a per-expert correction bias (``e_score_correction_bias``, used for
  selection only), top ``topk_group`` of ``n_group`` groups, top-k within them, weights renormalised and scaled by
  ``routed_scaling_factor``. The bias is megatron's expert bias: aux-loss-free balancing updates it after each
  optimizer step (rate 1e-3, megatron's default), and weight pushes carry it to the engines.

GLM-4.7-Flash is DeepSeek-V3's architecture (`rlx.train.mla.deepseek_v3_spec`: multi-head latent attention and
the same router), with its dense and sparse layers listed in ``mlp_layer_types``.

The multi-token-prediction layer checkpoints carry after the last layer (``num_nextn_predict_layers``) is written back
unchanged, or trained with ``train.objective.mtp_loss_coef`` (core's `rlx.train.mtp`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlx import hookimpl
from rlx.hookspecs import Register
from rlx.train.decoder import DecoderSpec, decoder_flops
from rlx.train.mla import MLADecoderSpec, deepseek_v3_spec
from rlx.train.moe import deepseek_router
from rlx.train.spec import ModelBridge, rope_theta

if TYPE_CHECKING:
    from rlx.train.dsa import DSADecoderSpec


def partial_rotary(c: Any) -> float:
    rope = getattr(c, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    return float(factor or getattr(c, "partial_rotary_factor", None) or 1.0)


class Glm4MoeBridge:
    name = "glm4-moe"
    model_types = ("glm4_moe",)

    def spec(self, hf_config: Any) -> DecoderSpec:
        c = hf_config
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        shape = deepseek_router(c, frozenset(range(c.first_k_dense_replace, c.num_hidden_layers)))
        return DecoderSpec(
            model_type=c.model_type, hf_config=c, num_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
            hidden_size=c.hidden_size, max_positions=c.max_position_embeddings,
            tied=bool(getattr(c, "tie_word_embeddings", False)), rope_theta=rope_theta(c),
            rotary_percent=partial_rotary(c),
            flops=decoder_flops(c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size, kv_heads,
                                heads, shape),
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=c.intermediate_size, rms_eps=c.rms_norm_eps,
            qk_norm=bool(getattr(c, "use_qk_norm", False)), qkv_bias=bool(getattr(c, "attention_bias", False)),
            moe=shape,
        )


class Glm4MoeLiteBridge:
    name = "glm4-moe-lite"
    model_types = ("glm4_moe_lite",)

    def spec(self, hf_config: Any) -> MLADecoderSpec:
        c = hf_config
        return deepseek_v3_spec(c, [i for i, kind in enumerate(c.mlp_layer_types) if kind == "sparse"])


class GlmMoeDsaBridge:
    """GLM-5 (``glm_moe_dsa``): GLM-4.7-Flash's architecture (DeepSeek-V3's) with DeepSeek sparse attention
    (`rlx.train.dsa`): an indexer with interleaved rotary pairs, and ``shared`` layers reusing the previous full
    layer's selection (``indexer_types``)."""

    name = "glm-moe-dsa"
    model_types = ("glm_moe_dsa",)

    def spec(self, hf_config: Any) -> DSADecoderSpec:
        from rlx.train.dsa import dsa_spec  # (megatron's modules: imported when a spec is made)
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRotaryEmbedding

        c = hf_config
        return dsa_spec(c, [i for i, kind in enumerate(c.mlp_layer_types) if kind == "sparse"], interleaved=True,
                        rotary=GlmMoeDsaRotaryEmbedding(c))


@hookimpl
def register_models(register: Register[type[ModelBridge]]) -> None:
    register(Glm4MoeBridge)
    register(Glm4MoeLiteBridge)
    register(GlmMoeDsaBridge)
