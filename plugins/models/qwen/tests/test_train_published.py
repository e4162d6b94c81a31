"""`rl train` on Qwen3.5 as Qwen publishes it (``qwen3_5``: a vision-language wrapper): the language model trains
and is pushed by the checkpoint's names (``model.language_model.*``), the engine serves what the trainer holds,
and the export loads as the published checkpoint does, vision tower included and unchanged."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlx.orchestrate.metrics import read
from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration


def test_a_published_qwen3_5_trains_and_exports_with_its_vision_tower(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from rlx.models.tiny import resolve_model_path

    source = resolve_model_path("builtin://tiny-qwen3.5")
    cfg = small_run_config(tmp_path, "run", model={"path": "builtin://tiny-qwen3.5"}, ray={"enabled": False},
                           train={"num_steps": 3}, weight_sync={"verify": "full", "verify_full_interval": 1})
    run = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = read(tmp_path / "run")
    assert len(rows) == 3
    assert max(r["train_rollout_logprob_diff"] for r in rows) < 1e-4  # the engine serves what the trainer holds

    def tensors(folder):
        out = {}
        for f in Path(folder).glob("*.safetensors"):
            out.update(load_file(str(f)))
        return out

    before, after = tensors(source), tensors(tmp_path / "hf")
    assert set(after) == set(before)
    visual = [n for n in before if n.startswith("model.visual.")]
    assert visual and all(torch.equal(after[n], before[n]) for n in visual)
    assert not torch.equal(after["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"],
                           before["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"])
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert torch.equal(model.model.language_model.norm.weight, after["model.language_model.norm.weight"])
    assert torch.equal(model.model.visual.pos_embed.weight, before["model.visual.pos_embed.weight"])
