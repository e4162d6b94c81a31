"""`rl train` on Kimi-K2.5 as Moonshot publishes it (``kimi_k25``: DeepSeek-V3 wrapped with a vision tower, named
``language_model.model.*``): the engine (transformers' whole wrapper) takes pushes by the checkpoint's names and
serves what the trainer holds; the export loads in transformers, the vision tower and projector unchanged."""

import pytest

from rlx.testing.runs import train_and_export

pytestmark = pytest.mark.integration


def test_a_published_kimi_k25_trains_and_exports_with_its_vision_tower(tmp_path):
    import torch

    from rlx.models.load import load_lm

    run = train_and_export(tmp_path, "builtin://tiny-kimi-k2.5")
    rows, before, after = run["rows"], run["before"], run["after"]
    assert len(rows) == 3 and max(r["train_rollout_logprob_diff"] for r in rows) < 1e-4
    assert set(after) == set(before)
    carried = [n for n in before if not n.startswith("language_model.")]
    assert any(n.startswith("vision_tower.") for n in carried) and any("mm_projector" in n for n in carried)
    assert all(torch.equal(after[n], before[n]) for n in carried)
    name = "language_model.model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert not torch.equal(after[name], before[name])
    model = load_lm(tmp_path / "hf", torch.float32)
    assert torch.equal(model.model.language_model.layers[1].self_attn.kv_a_proj_with_mqa.weight, after[name])


def test_a_kimi_k2_text_checkpoint_trains(tmp_path):
    """Kimi-K2's text-only checkpoints: DeepSeek-V3's tensors under ``model_type: kimi_k2``, which transformers does
    not know (read as the ``DeepseekV3ForCausalLM`` the config names, by the trainer and the engine)."""
    import json
    import shutil

    import torch

    from rlx.models.tiny import resolve_model_path

    folder = tmp_path / "kimi-k2"
    shutil.copytree(resolve_model_path("builtin://tiny-deepseek-v3"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    run = train_and_export(tmp_path, str(folder))
    assert len(run["rows"]) == 3 and max(r["train_rollout_logprob_diff"] for r in run["rows"]) < 1e-4
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert not torch.equal(run["after"][name], run["before"][name])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "kimi_k2"
