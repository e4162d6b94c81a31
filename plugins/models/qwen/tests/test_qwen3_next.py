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


VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)


def write_published(folder, model_type):
    """A Qwen3.5 checkpoint as Qwen publishes it: the vision-language wrapper, language model and vision tower."""
    import transformers

    config_cls, model_cls, extra = {
        "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(intermediate_size=48)),
        "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", EXPERTS),
    }[model_type]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(text_config={**COMMON, **extra}, vision_config=VISION,
                                               tie_word_embeddings=False)
    m = getattr(transformers, model_cls)(config)
    spread_weights(m)
    m.save_pretrained(folder)


class TestQwen35Published(ModelBridgeContract):
    """Qwen3.5 as published: ``model.language_model.*`` trained, ``model.visual.*`` carried."""

    bridge_name = "qwen3.5"
    model_type = "qwen3_5"
    layouts = [(1, 1), (2, 2)]

    def make_checkpoint(self, folder):
        write_published(folder, "qwen3_5")


class TestQwen35MoePublished(ModelBridgeContract):
    bridge_name = "qwen3.5"
    model_type = "qwen3_5_moe"
    layouts = [(1, 1), (2, 1, 2)]

    def make_checkpoint(self, folder):
        write_published(folder, "qwen3_5_moe")


def test_a_published_checkpoint_names_its_parts(tmp_path):
    from rlx.train.spec import HFCheckpoint, model_spec
    from rlx.plugins import build_plugins

    write_published(tmp_path, "qwen3_5")
    spec = model_spec(tmp_path, build_plugins())
    names = HFCheckpoint(tmp_path).names()
    carried = spec.carried(names)
    assert carried and all(n.startswith("model.visual.") for n in carried)
    assert len(carried) == sum(n.startswith("model.visual.") for n in names)
    assert spec.read(tmp_path).shape("model.layers.0.linear_attn.in_proj_z.weight") == [32, 32]
    assert spec.wrapper.outer("lm_head.weight") == "lm_head.weight" and spec.num_layers == 4


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


PACKED_SCRIPT = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from rlx.train.megatron_patches.cpu import enable
enable()
folder, port = sys.argv[1:3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
model_parallel_cuda_manual_seed(1)
from rlx.config import ParallelConfig
from rlx.plugins import build_plugins
from rlx.train import gdn
from rlx.train.masks import BlockCausal
from rlx.train.spec import HFCheckpoint, Stage, model_spec
spec = model_spec(folder, build_plugins())
stage = Stage(0, spec.num_layers, True, True)
model = spec.build(spec.transformer_config(ParallelConfig(), torch.float32), stage)
model.load_state_dict(dict(spec.to_megatron(HFCheckpoint(folder), stage)), strict=False)
g = torch.Generator().manual_seed(0)
a, b = (torch.randint(3, spec.vocab_size, (n,), generator=g) for n in (7, 5))
probe = torch.randn(12, spec.vocab_size, generator=g)

def run(ids, blocks):
    model.zero_grad()
    n = len(ids)
    logits = model(ids[None], torch.arange(n)[None], attention_mask=BlockCausal([blocks], n))[0]
    (logits * probe[:n]).sum().backward()
    return logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

packed, grads = run(torch.cat([a, b]), [7, 5])
alone_a, grads_a = run(a, [7])
alone_b, grads_b = run(b, [5])
probe_b = probe[7:]
model.zero_grad()
lb = model(b[None], torch.arange(5)[None], attention_mask=BlockCausal([[5]], 5))[0]
(lb * probe_b).sum().backward()
grads_b = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
err = ((packed - torch.cat([alone_a, alone_b])).abs().max() / packed.abs().max()).item()  # relative to the logits' scale
gerr = max(((grads[k] - grads_a.get(k, 0) - grads_b.get(k, 0)).abs().max() / grads[k].abs().max().clamp(min=1e-30)).item()
           for k in grads)  # relative to each gradient's largest entry
one = gdn.sequence_offsets
gdn.sequence_offsets = lambda mask, rows, width, device: one(None, rows, width, device)  # no varlen in GDN layers
leaky, _ = run(torch.cat([a, b]), [7, 5])
leak = (leaky[7:] - alone_b).abs().max().item()
print("RESULT", json.dumps({"logits": err, "grads": gerr, "without_varlen": leak}))
"""


@pytest.mark.integration
def test_a_packed_row_equals_each_sample_alone(tmp_path):
    """Two samples packed in one row give the logits and (summed) gradients of each alone, relative to their scale:
    the GDN layers' convolution and recurrence start afresh at the second sample. Without the per-sample offsets the second
    sample's logits differ (state carried over), so the check can fail."""
    import json
    import subprocess
    import sys

    from rlx.rollout.engines.launch import free_port

    write(tmp_path, "qwen3_next")
    r = subprocess.run([sys.executable, "-c", PACKED_SCRIPT, str(tmp_path), str(free_port())], capture_output=True,
                       text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, r.stderr[-3000:]
    got = json.loads(lines[0][len("RESULT "):])
    # fp32: the packed row sums each gradient over both samples' tokens in another order than the two runs do
    assert got["logits"] < 1e-6 and got["grads"] < 5e-5, got
    assert got["without_varlen"] > 1e-2, got


def test_qwen_mtp_tensors_are_carried():
    """Qwen3-Next and Qwen3.5 publish their multi-token-prediction module as ``mtp.*`` (transformers ignores it): the
    trainer does not hold it, so export writes it back unchanged."""
    from rlx.models.tiny import resolve_model_path
    from rlx.plugins import build_plugins
    from rlx.train.spec import model_spec

    spec = model_spec(resolve_model_path("builtin://tiny-qwen3-next"), build_plugins())
    names = ["mtp.fc.weight", "mtp.layers.0.mlp.gate.weight", "model.layers.0.input_layernorm.weight"]
    assert spec.carried(names) == names[:2]
