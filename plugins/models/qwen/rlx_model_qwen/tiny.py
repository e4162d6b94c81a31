"""``builtin://tiny-qwen3-moe``: a random Qwen3-MoE with the built-in tokenizer, small enough to train on a CPU
(2 layers, 8 experts of width 32, 2 per token: about 0.2 M parameters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHAPE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def qwen3_moe_config(tokenizer: Any, **shape: Any) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=False,
                          eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **{**SHAPE, **shape})


def build_tiny_qwen3_moe(out: Path, seed: int = 0, **shape: Any) -> Path:
    import torch
    from transformers import Qwen3MoeForCausalLM

    from rlx.models.tiny import build_tokenizer, save_tiny

    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(qwen3_moe_config(tok, **shape))
    return save_tiny(Path(out), model, tok)


NEXT_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def build_tiny_qwen3_next(out: Path, seed: int = 0, **shape: Any) -> Path:
    """``builtin://tiny-qwen3-next``: a random Qwen3-Next (GDN and gated attention layers, 8 experts and a gated
    shared expert; about 0.5 M parameters) with the built-in tokenizer."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from rlx.models.tiny import build_tokenizer, save_tiny

    tok = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen3NextConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=False,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                             bos_token_id=None, **{**NEXT_SHAPE, **shape})
    return save_tiny(Path(out), Qwen3NextForCausalLM(config), tok)


VISION_SHAPE = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def build_tiny_qwen3_5(out: Path, seed: int = 0, **shape: Any) -> Path:
    """``builtin://tiny-qwen3.5``: a random Qwen3.5 in the layout Qwen publishes (``qwen3_5``: the vision-language
    wrapper, a language model of GDN and gated attention layers with dense MLPs, and a vision tower of depth 2) with
    the built-in tokenizer; about 0.4 M parameters."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from rlx.models.tiny import build_tokenizer, save_tiny

    tok = build_tokenizer()
    text = {k: v for k, v in NEXT_SHAPE.items() if k not in ("num_experts", "num_experts_per_tok",
                                                              "moe_intermediate_size", "shared_expert_intermediate_size",
                                                              "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
    config = Qwen3_5Config(
        text_config=dict(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=False,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                         bos_token_id=None, **{**text, **shape}),
        vision_config=VISION_SHAPE, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return save_tiny(Path(out), Qwen3_5ForConditionalGeneration(config), tok)
