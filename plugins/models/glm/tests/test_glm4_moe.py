"""The GLM-4.5 bridge: the model-bridge contract (exact round trips over tensor, pipeline and expert parallel
layouts, megatron logits equal to transformers') with a dense first layer, shared experts, grouped sigmoid routing
with a correction bias, q/k/v bias and rotary on half of each head."""

import pytest
import torch

from rlx.testing import ModelBridgeContract
from rlx.testing.models import spread_weights


def write_glm4_moe(folder, **shape):
    from transformers import Glm4MoeForCausalLM

    from rlx_model_glm.tiny import glm4_moe_config

    class Tok:  # the config needs only these of a tokenizer
        pad_token_id = 0

        def __len__(self):
            return 96

        def convert_tokens_to_ids(self, t):
            return 1

    torch.manual_seed(0)
    c = glm4_moe_config(Tok(), **{**dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, n_routed_experts=4, routed_scaling_factor=2.5), **shape})
    m = Glm4MoeForCausalLM(c)
    spread_weights(m)
    m.save_pretrained(folder)


class TestGlm4MoeBridge(ModelBridgeContract):
    bridge_name = "glm4-moe"
    model_type = "glm4_moe"
    layouts = [(1, 1), (2, 1), (1, 2), (1, 1, 2), (1, 1, 4), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write_glm4_moe(folder)


class TestGlm4MoeBridgeQkNormNoGroups(ModelBridgeContract):
    """qk-norm, no bias, one expert group, no scaling, full rotary."""

    bridge_name = "glm4-moe"
    model_type = "glm4_moe"
    layouts = [(1, 1), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write_glm4_moe(folder, use_qk_norm=True, attention_bias=False, n_group=1, topk_group=1,
                       routed_scaling_factor=1.0, partial_rotary_factor=1.0)


def test_spec_reads_the_family(tmp_path):
    from transformers import AutoConfig

    from rlx_model_glm import Glm4MoeBridge

    write_glm4_moe(tmp_path)
    spec = Glm4MoeBridge().spec(AutoConfig.from_pretrained(tmp_path))
    assert spec.moe.layers == {1, 2, 3} and spec.moe.shared_ffn == 16 and spec.moe.expert_bias
    assert spec.moe.score == "sigmoid" and (spec.moe.groups, spec.moe.group_topk) == (2, 1)
    assert spec.moe.scaling == 2.5 and spec.rotary_percent == 0.5 and spec.qkv_bias


def test_installed_it_is_listed_and_without_it_a_checkpoint_names_the_plugin(tmp_path, monkeypatch):
    import subprocess
    import sys

    from rlx.errors import RLXError
    from rlx.plugins import build_plugins
    from rlx.train.spec import model_spec

    listing = subprocess.run([sys.executable, "-m", "rlx_cli.main", "plugins"], capture_output=True, text=True,
                             timeout=120)
    assert listing.returncode == 0 and "glm4-moe" in listing.stdout and "rlx-model-glm" in listing.stdout
    write_glm4_moe(tmp_path)
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", "glm")  # as if uninstalled
    with pytest.raises(RLXError, match=r"'glm4_moe' checkpoint needs the rlx-model-glm model plugin.*"
                                       r"pip install \./plugins/models/glm"):
        model_spec(tmp_path, build_plugins())


def write_glm4_moe_lite(folder, **shape):
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    torch.manual_seed(0)
    c = Glm4MoeLiteConfig(**{**dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                                    kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                    routed_scaling_factor=1.8, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                    mlp_layer_types=["dense", "sparse", "dense", "sparse"]), **shape})
    m = Glm4MoeLiteForCausalLM(c)
    spread_weights(m)
    m.save_pretrained(folder)


class TestGlm4MoeLiteBridge(ModelBridgeContract):
    """GLM-4.7-Flash: latent attention (rotary rows in halves), dense and sparse layers interleaved by
    mlp_layer_types, DeepSeek's router with one group."""

    bridge_name = "glm4-moe-lite"
    model_type = "glm4_moe_lite"
    layouts = [(1, 1), (2, 1), (1, 2), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write_glm4_moe_lite(folder, rope_interleave=False)


def test_lite_spec_reads_the_layer_types(tmp_path):
    from transformers import AutoConfig

    from rlx_model_glm import Glm4MoeLiteBridge

    write_glm4_moe_lite(tmp_path)
    spec = Glm4MoeLiteBridge().spec(AutoConfig.from_pretrained(tmp_path))
    assert spec.moe.layers == {1, 3} and spec.moe.groups is None and spec.moe.scaling == 1.8
    assert (spec.mla.q_lora, spec.mla.kv_lora, spec.mla.rope_type, spec.mla.interleaved) == (16, 12, "rope", True)


def write_glm5(folder, **shape):
    from transformers import GlmMoeDsaForCausalLM

    from rlx_model_glm.tiny import glm5_config

    torch.manual_seed(0)
    c = glm5_config(96, **{**dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, q_lora_rank=16,
                                  kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                  n_routed_experts=4, index_topk=4, index_head_dim=8, routed_scaling_factor=2.5),
                           **shape})
    m = GlmMoeDsaForCausalLM(c)
    spread_weights(m)
    m.save_pretrained(folder)


class TestGlm5Bridge(ModelBridgeContract):
    """GLM-5: latent attention with DeepSeek sparse attention (each query keeps 4 of up to 12 keys in the logits
    check), shared-selection layers, dense and sparse MLP layers."""

    bridge_name = "glm-moe-dsa"
    model_type = "glm_moe_dsa"
    layouts = [(1, 1), (2, 1), (1, 2), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write_glm5(folder)


def test_a_pipeline_stage_must_start_at_a_full_indexer_layer(tmp_path):
    from rlx.errors import RLXError
    from rlx.plugins import build_plugins
    from rlx.train.spec import Stage, model_spec

    write_glm5(tmp_path, indexer_types=["full", "full", "shared", "full"])
    spec = model_spec(tmp_path, build_plugins())
    with pytest.raises(RLXError, match="stage starting at layer 2 starts with a layer that reuses"):
        spec.layer_spec(None, Stage(2, 2, False, True))
