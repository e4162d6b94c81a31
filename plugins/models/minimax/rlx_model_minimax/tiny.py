"""``builtin://tiny-minimax-m2``: a random MiniMax-M2-shaped model with the built-in tokenizer, small enough to train
on a CPU (2 layers, 8 experts of width 32, 2 per token; 4 query heads over 2 key-value heads of 16, half rotary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHAPE = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2)


def minimax_m2_config(vocab: int, eos: int | None = None, pad: int | None = None, **shape: Any) -> Any:
    from transformers import MiniMaxM2Config

    return MiniMaxM2Config(vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=False,
                           eos_token_id=eos, pad_token_id=pad, bos_token_id=None, **{**SHAPE, **shape})


def build_tiny_minimax_m2(out: Path, seed: int = 0, **shape: Any) -> Path:
    import torch
    from transformers import MiniMaxM2ForCausalLM

    from rlx.models.tiny import build_tokenizer, save_tiny

    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = MiniMaxM2ForCausalLM(minimax_m2_config(len(tok), tok.convert_tokens_to_ids("<|im_end|>"),
                                                   tok.pad_token_id, **shape))
    with torch.no_grad():  # a correction bias that matters, as a trained model's does
        g = torch.Generator().manual_seed(seed)
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.normal_(0, 0.05, generator=g)
    return save_tiny(Path(out), model, tok)
