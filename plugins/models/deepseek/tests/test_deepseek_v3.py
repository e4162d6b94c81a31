"""The DeepSeek-V3 bridge: the model-bridge contract (exact round trips over tensor, pipeline and expert parallel
layouts, megatron logits equal to transformers') with latent attention under YaRN, a dense first layer, shared
experts and grouped sigmoid routing with a correction bias; and the variants a checkpoint may carry (no query
latent, plain rotary, rotary rows not interleaved)."""

import math

import pytest
import torch

from rlx.testing import ModelBridgeContract
from rlx.testing.models import spread_weights


class Tok:  # the config needs only these of a tokenizer
    pad_token_id = 0

    def __len__(self):
        return 96

    def convert_tokens_to_ids(self, t):
        return 1


def write_deepseek_v3(folder, rope=None, **shape):
    from transformers import DeepseekV3ForCausalLM

    from rlx_model_deepseek.tiny import deepseek_v3_config

    torch.manual_seed(0)
    c = deepseek_v3_config(Tok(), rope, **{**dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                                 q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                                                 qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4,
                                                 routed_scaling_factor=2.5), **shape})
    m = DeepseekV3ForCausalLM(c)
    spread_weights(m)
    m.save_pretrained(folder)


def write_kimi_k25(folder):
    """Kimi-K2.5 as Moonshot publishes it: the wrapper around DeepSeek-V3, with a vision tower and projector."""
    from rlx_model_deepseek.tiny import deepseek_v3_config, kimi_k25_model, save_published_kimi

    text = deepseek_v3_config(Tok(), None, **dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                                  q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                                                  qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4))
    m = kimi_k25_model(text)
    spread_weights(m)
    save_published_kimi(m, folder)


def write_kimi_k2(folder):
    """Kimi-K2's text-only checkpoints: DeepSeek-V3's tensors, ``model_type: kimi_k2``."""
    import json

    write_deepseek_v3(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))


class TestKimiK25Bridge(ModelBridgeContract):
    bridge_name = "kimi-k2"
    model_type = "kimi_k25"
    layouts = [(1, 1), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write_kimi_k25(folder)


class TestKimiK2Bridge(ModelBridgeContract):
    bridge_name = "kimi-k2"
    model_type = "kimi_k2"
    layouts = [(1, 1), (2, 1, 2)]

    def make_checkpoint(self, folder):
        write_kimi_k2(folder)


def test_kimi_k25_as_published_loads_in_transformers_as_built(tmp_path):
    """The published layout written for the tiny checkpoints is the one transformers reads: every tensor loads
    (none left at its initial value) and the logits are the built model's."""
    from rlx.models.load import load_lm
    from rlx_model_deepseek.tiny import deepseek_v3_config, kimi_k25_model, save_published_kimi

    built = kimi_k25_model(deepseek_v3_config(Tok(), None, num_hidden_layers=2, first_k_dense_replace=1)).eval()
    spread_weights(built)
    save_published_kimi(built, tmp_path)
    loaded = load_lm(tmp_path, torch.float32).eval()
    assert set(built.state_dict()) == set(loaded.state_dict())
    assert all(torch.equal(t, loaded.state_dict()[n]) for n, t in built.state_dict().items())
    ids = torch.tensor([[3, 9, 27, 4]])
    with torch.no_grad():
        assert torch.equal(built(input_ids=ids).logits, loaded(input_ids=ids).logits)


class TestDeepseekV3FP8(ModelBridgeContract):
    """As DeepSeek publishes it: the layers' projections in FP8 with block scales, read dequantised. Blocks of 4
    here: transformers, the oracle of the logits check, takes the block size from the scale grid and so reads ragged
    edge blocks wrongly (rlx reads them as DeepSeek's own kernels do: tests/unit/test_fp8.py)."""

    bridge_name = "deepseek-v3"
    model_type = "deepseek_v3"
    layouts = [(1, 1), (2, 1), (2, 2, 2)]

    def make_checkpoint(self, folder):
        from rlx.models.fp8 import write_quantized

        write_deepseek_v3(folder)
        write_quantized(folder, folder, (4, 4))


class TestDeepseekV3MTP(ModelBridgeContract):
    """With the multi-token-prediction layer DeepSeek publishes after the last layer: carried unchanged while frozen,
    converted exactly when it trains (one stage; TP=2 x EP=2 too)."""

    bridge_name = "deepseek-v3"
    model_type = "deepseek_v3"
    layouts = [(1, 1), (2, 2, 2), (2, 1, 2)]

    def make_checkpoint(self, folder):
        from rlx.testing.models import with_mtp_layer

        write_deepseek_v3(folder)
        with_mtp_layer(folder)


def write_deepseek_v32(folder):
    from transformers import DeepseekV32ForCausalLM

    from rlx_model_deepseek.tiny import deepseek_v32_config

    torch.manual_seed(0)
    m = DeepseekV32ForCausalLM(deepseek_v32_config(96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                                   q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                                                   qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, index_topk=4,
                                                   index_head_dim=8, routed_scaling_factor=2.5))
    spread_weights(m)
    m.save_pretrained(folder)


class TestDeepseekV32Bridge(ModelBridgeContract):
    """DeepSeek-V3.2: sparse attention in every layer, its indexer rotating halves (each query keeps 4 of up to 12
    keys in the logits check)."""

    bridge_name = "deepseek-v3.2"
    model_type = "deepseek_v32"
    layouts = [(1, 1), (2, 1), (1, 2), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write_deepseek_v32(folder)


class TestDeepseekV3Bridge(ModelBridgeContract):
    bridge_name = "deepseek-v3"
    model_type = "deepseek_v3"
    layouts = [(1, 1), (2, 1), (1, 2), (1, 1, 2), (1, 1, 4), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write_deepseek_v3(folder)


class TestDeepseekV3BridgeNoQueryLatentPlainRope(ModelBridgeContract):
    """One q_proj (no query latent), plain rotary, rotary rows in halves (rope_interleave: false), one expert
    group."""

    bridge_name = "deepseek-v3"
    model_type = "deepseek_v3"
    layouts = [(1, 1), (2, 2, 2)]

    def make_checkpoint(self, folder):
        write_deepseek_v3(folder, dict(rope_type="default", rope_theta=5000.0), q_lora_rank=None,
                          rope_interleave=False, n_group=1, topk_group=1)


class TestDeepseekV3BridgeYarnVariants(ModelBridgeContract):
    """YaRN with only mscale_all_dim stated and rotary rows in halves."""

    bridge_name = "deepseek-v3"
    model_type = "deepseek_v3"
    layouts = [(2, 1)]

    def make_checkpoint(self, folder):
        write_deepseek_v3(folder, dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                       original_max_position_embeddings=256, mscale_all_dim=0.7),
                          rope_interleave=False)


def test_spec_reads_the_family(tmp_path):
    from transformers import AutoConfig

    from rlx_model_deepseek import DeepseekV3Bridge

    write_deepseek_v3(tmp_path)
    spec = DeepseekV3Bridge().spec(AutoConfig.from_pretrained(tmp_path))
    assert spec.moe.layers == {1, 2, 3} and spec.moe.shared_ffn == 16 and spec.moe.expert_bias
    assert (spec.moe.groups, spec.moe.group_topk, spec.moe.scaling) == (2, 1, 2.5)
    m = spec.mla
    assert (m.q_lora, m.kv_lora, m.nope, m.rope, m.v, m.interleaved) == (16, 12, 8, 4, 6, True)
    assert (m.rope_type, m.factor, m.original_max_positions, m.mscale_all_dim) == ("yarn", 4.0, 512, 1.0)
    assert m.mscale == pytest.approx(1.0)  # mscale == mscale_all_dim: cos/sin unscaled, softmax by mscale(4)²


@pytest.mark.parametrize("rope,softmax,cos_sin", [
    # by hand from transformers' rules: attention factor mscale(f, ms) / mscale(f, mad) when both are set, else
    # mscale(f) (unless stated); the softmax carries mscale(f, mad)² only when mscale_all_dim is set
    (dict(factor=40.0, mscale=1.0, mscale_all_dim=1.0), (0.1 * math.log(40) + 1) ** 2, 1.0),
    (dict(factor=40.0, mscale=0.707, mscale_all_dim=0.707), (0.0707 * math.log(40) + 1) ** 2, 1.0),
    (dict(factor=8.0, mscale_all_dim=0.5), (0.05 * math.log(8) + 1) ** 2, 0.1 * math.log(8) + 1),
    (dict(factor=8.0), 1.0, 0.1 * math.log(8) + 1),
    (dict(factor=8.0, attention_factor=1.3, mscale_all_dim=1.0), (0.1 * math.log(8) + 1) ** 2, 1.3),
])
def test_yarn_scales_as_transformers(rope, softmax, cos_sin):
    """The softmax scale and the cos/sin factor megatron's own code computes from the solved settings equal
    transformers' own (its YaRN parameters and DeepSeek's attention scaling) and the values by hand."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor,
        _yarn_get_mscale,
    )
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from rlx.train.mla import MLAShape

    c = DeepseekV3Config(num_hidden_layers=1, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0,
                                                                 original_max_position_embeddings=4096, **rope))
    s = MLAShape.from_hf(c)
    hf_softmax = yarn_apply_mscale(c.rope_parameters, 1.0)
    hf_cos_sin = _compute_yarn_parameters(c)[1]
    megatron_softmax = _yarn_get_mscale(s.factor, s.mscale_all_dim) ** 2  # MLA: mscale² / sqrt(d)
    megatron_cos_sin = _yarn_get_concentration_factor(s.factor, s.mscale, s.mscale_all_dim)
    assert megatron_softmax == pytest.approx(hf_softmax, rel=1e-12) and hf_softmax == pytest.approx(softmax)
    assert megatron_cos_sin == pytest.approx(hf_cos_sin, rel=1e-12) and hf_cos_sin == pytest.approx(cos_sin)


def test_latent_norms_use_transformers_eps_not_the_models():
    from types import SimpleNamespace

    from rlx.train.mla import LatentRMSNorm

    norm = LatentRMSNorm(SimpleNamespace(params_dtype=torch.float32), 8, eps=1e-5)  # megatron passes rms_norm_eps
    assert norm.eps == 1e-6


@pytest.mark.parametrize("change,message", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_key_value_heads=2), "num_key_value_heads 2"),
    (dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4)), "rope_type 'linear'"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=1e4, original_max_position_embeddings=64,
                               truncate=False)), "truncate"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(n_group=2, topk_group=1, num_experts_per_tok=4), "best 2 experts"),
    (dict(n_group=2, topk_group=None), "no topk_group"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=1e4)), "original_max_position_embeddings"),
])
def test_configs_megatron_cannot_reproduce_are_refused(change, message):
    from transformers import DeepseekV3Config

    from rlx.errors import RLXError
    from rlx_model_deepseek import DeepseekV3Bridge

    c = DeepseekV3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                         num_experts_per_tok=2, first_k_dense_replace=1)
    for k, v in change.items():
        setattr(c, k, v)
    with pytest.raises(RLXError, match=message):
        DeepseekV3Bridge().spec(c)


def test_keeping_every_group_is_no_grouping():
    from transformers import DeepseekV3Config

    from rlx_model_deepseek import DeepseekV3Bridge

    c = DeepseekV3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                         num_experts_per_tok=4, first_k_dense_replace=1, n_group=2, topk_group=2)
    assert DeepseekV3Bridge().spec(c).moe.groups is None


def test_flops_count_latent_projections_and_active_experts(tmp_path):
    """Per token: latent projections, up projections and output per layer, the MLP's active width (a dense layer's
    intermediate size or top-k experts plus the shared one) and the LM head; per (query, key) pair each head's
    q·k over nope+rope and weights·values over v, halved (causal). By hand for the test model."""
    from transformers import AutoConfig

    from rlx_model_deepseek import DeepseekV3Bridge

    write_deepseek_v3(tmp_path)
    f = DeepseekV3Bridge().spec(AutoConfig.from_pretrained(tmp_path)).flops
    hidden, heads, layers, vocab = 32, 4, 4, 96
    attention = 16 * (32 + 4 * 12) + 32 * (12 + 4) + 12 * 4 * (8 + 6) + 4 * 6 * 32
    mlp = (48 + 3 * (2 * 16 + 16)) / 4 * 3 * hidden
    assert f.a == layers * (attention + mlp) + hidden * vocab
    assert f.b == layers * heads * (12 + 6) / 2


def test_installed_it_is_listed_and_without_it_a_checkpoint_names_the_plugin(tmp_path, monkeypatch):
    import subprocess
    import sys

    from rlx.errors import RLXError
    from rlx.plugins import build_plugins
    from rlx.train.spec import model_spec

    listing = subprocess.run([sys.executable, "-m", "rlx_cli.main", "plugins"], capture_output=True, text=True,
                             timeout=120)
    assert listing.returncode == 0 and "deepseek-v3" in listing.stdout and "rlx-model-deepseek" in listing.stdout
    write_deepseek_v3(tmp_path)
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", "deepseek")  # as if uninstalled
    with pytest.raises(RLXError, match=r"'deepseek_v3' checkpoint needs the rlx-model-deepseek model plugin.*"
                                       r"pip install \./plugins/models/deepseek"):
        model_spec(tmp_path, build_plugins())
