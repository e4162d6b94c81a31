"""Built-in model bridge: the Llama family (Llama, Qwen2, Qwen3, Mistral) on megatron-core's GPTModel.

An ordinary plugin using only the public bridge API (`rlx.train.spec`, `rlx.train.decoder`), as third-party
model plugins do: the family is the standard decoder (`DecoderSpec`) with qk-norm for Qwen3 and a qkv bias for
Qwen2, so the bridge only reads its HF config.
"""

from __future__ import annotations


from rlx import hookimpl
from rlx.hookspecs import Register
from rlx.train.decoder import DecoderSpec, decoder_flops
from rlx.train.spec import ModelBridge, rope_theta
from rlx.types import HFConfig


class LlamaBridge:
    """Llama-style decoders: RMSNorm, RoPE, GQA, SwiGLU (+ qk-norm for Qwen3, qkv bias for Qwen2)."""

    name = "llama"
    model_types = ("llama", "qwen2", "qwen3", "mistral")

    def spec(self, hf_config: HFConfig) -> DecoderSpec:
        c = hf_config
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return DecoderSpec(
            model_type=c.model_type, hf_config=c, num_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
            hidden_size=c.hidden_size, max_positions=c.max_position_embeddings,
            tied=bool(getattr(c, "tie_word_embeddings", False)), rope_theta=rope_theta(c),
            flops=decoder_flops(c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size, kv_heads,
                                heads),
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=c.intermediate_size, rms_eps=c.rms_norm_eps,
            qk_norm=c.model_type == "qwen3",
            qkv_bias=c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
        )


@hookimpl
def register_models(register: Register[type[ModelBridge]]) -> None:
    register(LlamaBridge)
