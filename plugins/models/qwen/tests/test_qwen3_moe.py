"""The Qwen3-MoE bridge: the model-bridge contract (exact round trips over tensor, pipeline and expert parallel
layouts; megatron logits equal to transformers'), with dense and expert layers mixed and both router styles."""

import pytest
import torch

from rlx.testing import ModelBridgeContract
from rlx.testing.models import spread_weights


def write_qwen3_moe(folder, **shape):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    c = Qwen3MoeConfig(**{**dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                 mlp_only_layers=[0], tie_word_embeddings=False), **shape})
    m = Qwen3MoeForCausalLM(c)
    spread_weights(m)
    m.save_pretrained(folder)


class TestQwen3MoeBridge(ModelBridgeContract):
    """Through the installed entry point; layer 0 dense, layers 1-3 experts, renormalised top-k."""

    bridge_name = "qwen3-moe"
    model_type = "qwen3_moe"
    layouts = [(1, 1), (2, 1), (1, 2), (1, 1, 2), (1, 1, 4), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write_qwen3_moe(folder)


class TestQwen3MoeBridgeSoftmaxFirst(ModelBridgeContract):
    """``norm_topk_prob: false`` (softmax over every expert, no renormalisation), tied embeddings, sparse step 2."""

    bridge_name = "qwen3-moe"
    model_type = "qwen3_moe"
    layouts = [(1, 1), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write_qwen3_moe(folder, norm_topk_prob=False, tie_word_embeddings=True, mlp_only_layers=[],
                        decoder_sparse_step=2)


def test_spec_reads_the_family(tmp_path):
    from transformers import AutoConfig

    from rlx_model_qwen import Qwen3MoeBridge

    write_qwen3_moe(tmp_path, decoder_sparse_step=2, mlp_only_layers=[3])
    spec = Qwen3MoeBridge().spec(AutoConfig.from_pretrained(tmp_path))
    assert spec.moe.layers == {1}  # (i + 1) % 2 == 0 gives 1 and 3; 3 is listed dense
    assert spec.num_experts == 4 and spec.moe.topk == 2 and not spec.moe.pre_softmax
    # active FLOPs: the MoE layer counts its 2 routed experts of width 16, not all 4
    dense = Qwen3MoeBridge().spec(AutoConfig.from_pretrained(tmp_path)).flops
    assert dense.a == pytest.approx(4 * (2 * 32 * 32 * 1.5 + 3 * 32 * (3 * 48 + 32) / 4) + 32 * 96)


def test_tiny_model_is_built_offline_and_claimed(tmp_path):
    from transformers import AutoConfig

    from rlx.plugins import build_plugins
    from rlx_model_qwen.tiny import build_tiny_qwen3_moe

    build_tiny_qwen3_moe(tmp_path)
    c = AutoConfig.from_pretrained(tmp_path)
    assert c.model_type == "qwen3_moe" and c.num_experts == 8
    spec = build_plugins().bridge_for("qwen3_moe").spec(c)
    assert spec.moe.layers == {0, 1}


def test_installed_it_is_listed_and_without_it_a_checkpoint_names_the_plugin(tmp_path, monkeypatch):
    import subprocess
    import sys

    from rlx.errors import RLXError
    from rlx.plugins import build_plugins
    from rlx.train.spec import model_spec

    listing = subprocess.run([sys.executable, "-m", "rlx_cli.main", "plugins"], capture_output=True, text=True,
                             timeout=120)
    assert listing.returncode == 0 and "qwen3-moe" in listing.stdout and "rlx-model-qwen" in listing.stdout
    write_qwen3_moe(tmp_path)
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", "qwen")  # as if uninstalled
    with pytest.raises(RLXError, match=r"'qwen3_moe' checkpoint needs the rlx-model-qwen model plugin.*"
                                       r"pip install \./plugins/models/qwen"):
        model_spec(tmp_path, build_plugins())
