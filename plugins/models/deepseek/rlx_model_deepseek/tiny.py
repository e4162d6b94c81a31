"""``builtin://tiny-deepseek-v3``: a random DeepSeek-V3-shaped model with the built-in tokenizer, small enough to
train on a CPU (4 layers: one dense, three with 8 routed experts of width 32, 2 per token in 2 groups, and a
shared expert; latent attention with a query latent of 32 and a key/value latent of 32, YaRN rotary embedding)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHAPE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
             rope_interleave=True)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=512, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def deepseek_v3_config(tokenizer: Any, rope: dict[str, Any] | None = None, **shape: Any) -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=False,
                            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                            rope_parameters=dict(YARN if rope is None else rope), **{**SHAPE, **shape})


def build_tiny_deepseek_v3(out: Path, seed: int = 0, **shape: Any) -> Path:
    import torch
    from transformers import DeepseekV3ForCausalLM

    from rlx.models.tiny import build_tokenizer, save_tiny

    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_v3_config(tok, **shape))
    with torch.no_grad():  # a correction bias that matters, as a trained model's does
        g = torch.Generator().manual_seed(seed)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05, generator=g)
    return save_tiny(Path(out), model, tok)


KIMI_VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                   pos_emb_height=4, pos_emb_width=4)


def kimi_k25_model(text: Any, seed: int = 0) -> Any:
    """A random Kimi-K2.5 (transformers' model) around the DeepSeek-V3 text config `text`, with a vision tower of one
    block of width 32 (the default tower alone is 438 M parameters)."""
    import torch
    from transformers import AutoModelForImageTextToText, Kimi_K25Config

    config = Kimi_K25Config(text_config=text.to_dict(), vision_config=KIMI_VISION,
                            projection_hidden_size=KIMI_VISION["hidden_size"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config)


def save_published_kimi(model: Any, out: Path) -> Path:
    """`model` saved in the layout Moonshot publishes Kimi-K2.5 in (``language_model.model.layers.*``,
    ``language_model.lm_head``, ``vision_tower.*``, ``mm_projector.*``). transformers 5.24 writes the language
    model's layers as ``language_model.model.blocks.*`` (its vision tower's rename, reversed everywhere); they are
    renamed back."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(out)
    for f in Path(out).glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k.replace("language_model.model.blocks.", "language_model.model.layers."): v
                   for k, v in tensors.items()}, str(f), metadata={"format": "pt"})
    index = Path(out) / "model.safetensors.index.json"
    if index.exists():
        index.write_text(index.read_text().replace("language_model.model.blocks.", "language_model.model.layers."))
    return Path(out)


def build_tiny_kimi_k25(out: Path, seed: int = 0, **shape: Any) -> Path:
    """``builtin://tiny-kimi-k2.5``: a random Kimi-K2.5 in its published layout, its language model the tiny
    DeepSeek-V3's shape, with the built-in tokenizer."""
    from rlx.models.tiny import build_tokenizer

    tok = build_tokenizer()
    model = kimi_k25_model(deepseek_v3_config(tok, **shape), seed)
    save_published_kimi(model, Path(out))
    tok.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return Path(out)


def deepseek_v32_config(vocab: int, eos: int | None = None, pad: int | None = None, **shape: Any) -> Any:
    """DeepSeek-V3.2: the tiny DeepSeek-V3's shape with sparse attention (each query keeps its 8 best-scored keys;
    32 indexer heads, so that keys rarely tie: see `rlx_model_glm.tiny.build_tiny_glm5`)."""
    from transformers import DeepseekV32Config

    merged = {**SHAPE, "index_topk": 8, "index_head_dim": 16, "index_n_heads": 32, **shape}
    dense = merged.pop("first_k_dense_replace")
    merged.setdefault("mlp_layer_types", ["dense"] * dense + ["sparse"] * (merged["num_hidden_layers"] - dense))
    return DeepseekV32Config(vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=False,
                             eos_token_id=eos, pad_token_id=pad, bos_token_id=None, rope_parameters=dict(YARN),
                             **merged)


def build_tiny_deepseek_v32(out: Path, seed: int = 0, **shape: Any) -> Path:
    """``builtin://tiny-deepseek-v3.2``: `deepseek_v32_config` with the built-in tokenizer."""
    import torch
    from transformers import DeepseekV32ForCausalLM

    from rlx.models.tiny import build_tokenizer, save_tiny

    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(deepseek_v32_config(len(tok), tok.convert_tokens_to_ids("<|im_end|>"),
                                                       tok.pad_token_id, **shape))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05, generator=g)
    return save_tiny(Path(out), model, tok)
