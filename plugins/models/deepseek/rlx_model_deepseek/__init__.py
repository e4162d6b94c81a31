"""rlx model plugin for DeepSeek-V3 (``deepseek_v3``: DeepSeek-V3, V3.1, R1 and their distillations of the same
architecture) and the models built on it: Kimi-K2 (``kimi_k2``) and Kimi-K2.5 (``kimi_k25``, vision-language).

DeepSeek-V3 is rlx's standard decoder with multi-head latent attention (`rlx.train.mla`) and DeepSeek's router
(`rlx.train.moe.deepseek_router`):

* latent attention with a query latent (``q_lora_rank``) and a key/value latent (``kv_lora_rank``), rotary
  embedding on ``qk_rope_head_dim`` of each head, plain or YaRN (``rope_parameters.rope_type: yarn``, with
  megatron's YaRN solved to give transformers' attention factor and softmax scale);
* dense MLPs in the first ``first_k_dense_replace`` layers, then routed experts with ``n_shared_experts`` shared
  experts beside them;
* sigmoid scores plus a per-expert correction bias (selection only), the best ``topk_group`` of ``n_group``
  groups, top-k within them, weights renormalised and scaled by ``routed_scaling_factor``; aux-loss-free
  balancing updates the bias after each optimizer step (megatron's rate, 1e-3) and weight pushes carry it.

The multi-token-prediction layer checkpoints carry after the last layer (``num_nextn_predict_layers``, which
transformers ignores) is written back unchanged, or trained with ``train.objective.mtp_loss_coef`` (core's
`rlx.train.mtp`). FP8 checkpoints (``weight_scale_inv`` blocks) are read dequantised (`rlx.models.fp8`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlx import hookimpl
from rlx.hookspecs import Register
from rlx.train.mla import MLADecoderSpec, deepseek_v3_spec
from rlx.train.spec import ModelBridge, wrapped

if TYPE_CHECKING:
    from rlx.train.dsa import DSADecoderSpec


class DeepseekV3Bridge:
    name = "deepseek-v3"
    model_types = ("deepseek_v3",)

    def spec(self, hf_config: Any) -> MLADecoderSpec:
        c = hf_config
        return deepseek_v3_spec(c, range(c.first_k_dense_replace, c.num_hidden_layers))


class DeepseekV32Bridge:
    """DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 with DeepSeek sparse attention in every layer (`rlx.train.dsa`;
    the indexer rotates halves, not interleaved pairs)."""

    name = "deepseek-v3.2"
    model_types = ("deepseek_v32",)

    def spec(self, hf_config: Any) -> DSADecoderSpec:
        from rlx.train.dsa import dsa_spec  # (megatron's modules: imported when a spec is made)
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RotaryEmbedding

        c = hf_config
        layers = getattr(c, "mlp_layer_types", None)
        sparse = ([i for i, kind in enumerate(layers) if kind == "sparse"] if layers
                  else range(c.first_k_dense_replace, c.num_hidden_layers))
        return dsa_spec(c, sparse, interleaved=False, rotary=DeepseekV32RotaryEmbedding(c))


#: Kimi-K2.5's names of its language model's tensors
KIMI_K25 = (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))


class KimiBridge:
    """Moonshot's Kimi-K2 (``kimi_k2``: DeepSeek-V3's architecture under a model type of its own, which transformers
    reads as the ``DeepseekV3ForCausalLM`` its config names) and Kimi-K2.5 (``kimi_k25``: a vision-language wrapper
    whose ``text_config`` is DeepSeek-V3; its language model trains, its vision tower and projector are carried
    unchanged)."""

    name = "kimi-k2"
    model_types = ("kimi_k2", "kimi_k25")

    def spec(self, hf_config: Any) -> MLADecoderSpec:
        c = hf_config
        if c.model_type == "kimi_k25":
            return wrapped(DeepseekV3Bridge().spec(c.text_config), c, KIMI_K25)
        return DeepseekV3Bridge().spec(c)


@hookimpl
def register_models(register: Register[type[ModelBridge]]) -> None:
    register(DeepseekV3Bridge)
    register(DeepseekV32Bridge)
    register(KimiBridge)
