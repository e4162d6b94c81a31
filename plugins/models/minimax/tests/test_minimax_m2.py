"""The MiniMax-M2 bridge: the model-bridge contract (exact round trips over tensor, pipeline and expert parallel
layouts; megatron logits equal to transformers') with full-width q/k norms, half rotary and sigmoid routing with a
correction bias; a config option the bridge does not implement is refused, naming it."""

import pytest
import torch

from rlx.errors import RLXError
from rlx.testing import ModelBridgeContract
from rlx.testing.models import spread_weights


def write(folder, **shape):
    from transformers import MiniMaxM2ForCausalLM

    from rlx_model_minimax.tiny import minimax_m2_config

    torch.manual_seed(0)
    m = MiniMaxM2ForCausalLM(minimax_m2_config(96, **{**dict(hidden_size=32, intermediate_size=16, head_dim=8,
                                                              rotary_dim=4, num_local_experts=4), **shape}))
    spread_weights(m)
    m.save_pretrained(folder)


class TestMiniMaxM2Bridge(ModelBridgeContract):
    bridge_name = "minimax-m2"
    model_type = "minimax_m2"
    layouts = [(1, 1), (2, 1), (1, 2), (1, 1, 2), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write(folder)


def test_the_published_names_are_the_bridges(tmp_path):
    from rlx.plugins import build_plugins
    from rlx.train.spec import HFCheckpoint, model_spec

    write(tmp_path)
    names = HFCheckpoint(tmp_path).names()
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in names
    assert HFCheckpoint(tmp_path).shape("model.layers.0.self_attn.q_norm.weight") == [4 * 8]  # all heads, one norm
    spec = model_spec(tmp_path, build_plugins())
    assert spec.rotary_percent == 0.5 and spec.moe.score == "sigmoid" and spec.moe.expert_bias


def test_a_qk_norm_the_bridge_does_not_implement_is_refused(tmp_path):
    import json

    from rlx.plugins import build_plugins
    from rlx.train.spec import model_spec

    write(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "qk_norm_type": "per_head"}))
    with pytest.raises(RLXError, match="qk_norm_type 'per_head'"):
        model_spec(tmp_path, build_plugins())
