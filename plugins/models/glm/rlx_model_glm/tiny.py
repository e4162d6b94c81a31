"""``builtin://tiny-glm4-moe``: a random GLM-4.5-shaped model with the built-in tokenizer, small enough to train on
a CPU (4 layers: one dense, three with 8 routed experts of width 32, 2 per token in 2 groups, and a shared expert;
q/k/v bias, rotary on half of each head)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHAPE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
             routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5)


def glm4_moe_config(tokenizer: Any, **shape: Any) -> Any:
    from transformers import Glm4MoeConfig

    merged = {**SHAPE, **shape}
    partial = merged.pop("partial_rotary_factor")
    c = Glm4MoeConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=False,
                      eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=None, **merged)
    c.rope_parameters = {**(c.rope_parameters or {}), "partial_rotary_factor": partial}
    return c


def build_tiny_glm4_moe(out: Path, seed: int = 0, **shape: Any) -> Path:
    import torch
    from transformers import Glm4MoeForCausalLM

    from rlx.models.tiny import build_tokenizer, save_tiny

    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(glm4_moe_config(tok, **shape))
    with torch.no_grad():  # a correction bias that matters, as a trained model's does
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    return save_tiny(Path(out), model, tok)


GLM5_SHAPE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                  mlp_layer_types=["dense", "sparse", "sparse", "sparse"], index_topk=8, index_head_dim=16,
                  index_n_heads=32, indexer_types=["full", "shared", "full", "shared"])


def glm5_config(vocab: int, eos: int | None = None, pad: int | None = None, **shape: Any) -> Any:
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=False,
                           eos_token_id=eos, pad_token_id=pad, bos_token_id=None, **{**GLM5_SHAPE, **shape})


def build_tiny_glm5(out: Path, seed: int = 0, **shape: Any) -> Path:
    """``builtin://tiny-glm5``: a random GLM-5-shaped model (``glm_moe_dsa``) with the built-in tokenizer: latent
    attention with DeepSeek sparse attention (each query keeps its 8 best-scored keys; layers 1 and 3 reuse the
    selection of the layer before), one dense layer then three with 8 routed experts and a shared one. 32 indexer
    heads: with a few, a random model's keys often score exactly 0 (every head's relu), and which of the tied keys a
    query keeps then depends on how the rows are laid out (transformers' own forward picks others for another
    length)."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    from rlx.models.tiny import build_tokenizer, save_tiny

    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(glm5_config(len(tok), tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id,
                                             **shape))
    with torch.no_grad():  # a correction bias that matters, as a trained model's does
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    return save_tiny(Path(out), model, tok)
