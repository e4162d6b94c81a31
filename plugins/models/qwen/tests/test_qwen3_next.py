"""Qwen3-Next and Qwen3.5 text: the model-bridge contract (exact round trips over tensor and pipeline layouts;
megatron logits equal to transformers'), GDN and gated-attention layers mixed, experts with a gated shared expert
or dense MLPs."""

import pytest
import torch

from rlx.testing import ModelBridgeContract
from rlx.testing.models import spread_weights

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def write(folder, model_type, **shape):
    import transformers

    config_cls, model_cls = {
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
        "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
        "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    }[model_type]
    torch.manual_seed(0)
    extra = {"qwen3_next": dict(EXPERTS, intermediate_size=48, mlp_only_layers=[2]),
             "qwen3_5_text": dict(intermediate_size=48), "qwen3_5_moe_text": EXPERTS}[model_type]
    m = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **extra, **shape}))
    spread_weights(m)
    m.save_pretrained(folder)


class TestQwen3NextBridge(ModelBridgeContract):
    """Layers: GDN + experts, attention + experts, GDN + dense MLP, attention + experts."""

    bridge_name = "qwen3-next"
    model_type = "qwen3_next"
    layouts = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 1, 2), (2, 1, 2)]

    def make_checkpoint(self, folder):
        write(folder, "qwen3_next")


class TestQwen35Bridge(ModelBridgeContract):
    """Qwen3.5 dense: the flat GDN projections."""

    bridge_name = "qwen3.5"
    model_type = "qwen3_5_text"

    def make_checkpoint(self, folder):
        write(folder, "qwen3_5_text")


class TestQwen35MoeBridge(ModelBridgeContract):
    bridge_name = "qwen3.5"
    model_type = "qwen3_5_moe_text"
    layouts = [(1, 1), (2, 1), (1, 2), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write(folder, "qwen3_5_moe_text")


def test_spec_reads_the_family(tmp_path):
    from transformers import AutoConfig

    from rlx_model_qwen.next import Qwen3NextBridge

    write(tmp_path, "qwen3_next")
    spec = Qwen3NextBridge().spec(AutoConfig.from_pretrained(tmp_path))
    assert spec.layer_types == ("linear_attention", "full_attention", "linear_attention", "full_attention")
    assert spec.moe.layers == {0, 1, 3} and spec.moe.shared_ffn == 24 and spec.moe.shared_gate
    assert spec.rotary_percent == 0.25 and spec.gdn.per_key == 2 and not spec.gdn.flat
