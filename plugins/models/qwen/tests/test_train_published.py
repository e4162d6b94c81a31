"""`rl train` on Qwen3.5 as Qwen publishes it (``qwen3_5``: a vision-language wrapper): the language model trains
and is pushed by the checkpoint's names (``model.language_model.*``), the engine serves what the trainer holds,
and the export loads as the published checkpoint does, vision tower included and unchanged."""

import pytest

from rlx.testing.runs import train_and_export

pytestmark = pytest.mark.integration


def test_a_published_qwen3_5_trains_and_exports_with_its_vision_tower(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText

    run = train_and_export(tmp_path, "builtin://tiny-qwen3.5")
    rows, before, after = run["rows"], run["before"], run["after"]
    assert len(rows) == 3
    assert max(r["train_rollout_logprob_diff"] for r in rows) < 1e-4  # the engine serves what the trainer holds
    assert set(after) == set(before)
    visual = [n for n in before if n.startswith("model.visual.")]
    assert visual and all(torch.equal(after[n], before[n]) for n in visual)
    assert not torch.equal(after["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"],
                           before["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"])
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert torch.equal(model.model.language_model.norm.weight, after["model.language_model.norm.weight"])
    assert torch.equal(model.model.visual.pos_embed.weight, before["model.visual.pos_embed.weight"])


def test_a_published_qwen3_5_moe_trains(tmp_path):
    """The MoE wrapper (``qwen3_5_moe``), built in its published layout with the built-in tokenizer."""
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from rlx.models.tiny import build_tokenizer, save_tiny
    from rlx_model_qwen.tiny import NEXT_SHAPE, VISION_SHAPE

    tok = build_tokenizer()
    text = {k: v for k, v in NEXT_SHAPE.items() if k not in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")}
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config=dict(vocab_size=len(tok), tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), **text),
        vision_config=VISION_SHAPE, tie_word_embeddings=False))
    save_tiny(tmp_path / "model", model, tok)
    run = train_and_export(tmp_path, str(tmp_path / "model"))
    rows, before, after = run["rows"], run["before"], run["after"]
    assert len(rows) == 3 and max(r["train_rollout_logprob_diff"] for r in rows) < 1e-4
    assert set(after) == set(before)
    assert all(torch.equal(after[n], before[n]) for n in before if n.startswith("model.visual."))
    name = "model.language_model.layers.1.mlp.experts.3.down_proj.weight"
    assert not torch.equal(after[name], before[name])
