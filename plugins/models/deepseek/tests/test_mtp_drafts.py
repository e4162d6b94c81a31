"""MTP drafts in the embedded engine (`speculative.method: mtp`, `rlx.rollout.engines.embedded.mtp`) on DeepSeek-V3's
tiny checkpoint with an MTP layer in the published layout: the drafts are the MTP layer's predictions as a reference
built by hand from transformers' own layers makes them (at every step of every row, through prefill, forks, merges
and refused drafts), verification keeps plain decoding's tokens and log-probs, and a push of the MTP weights
changes the drafts. (`test_train_variants.py`: `rl train` with MTP drafts while the layer trains.)"""

import pytest
import torch

from rlx.testing.models import mtp_copy, mtp_draft_errors

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlx.models.load import load_lm
    from rlx.rollout.engines.embedded.weights import name_as_checkpoint

    path = str(mtp_copy("builtin://tiny-deepseek-v3", tmp_path_factory.mktemp("model") / "mtp"))
    model = load_lm(path, torch.float32).eval()
    name_as_checkpoint(model, path)  # (holds the MTP layer, as the engine does)
    return path, model, AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mtp_drafts_are_the_mtp_layers_predictions_and_verification_keeps_plain_decoding(served, temperature):
    got = mtp_draft_errors(served[0], temperature)
    assert got["drafted"] > 9 * 4  # every row drafted at every step (9 rows, at least 4 steps of 16 tokens each)
    assert got["draft"] < 1e-4 and got["logprob"] < 1e-5 and got["same"]


@torch.no_grad()  # (as the engine's thread)
def test_a_push_of_the_mtp_weights_changes_the_drafts(served):
    """The held MTP tensors are the draft layer's parameters: a push by name (as a run that trains the layer makes)
    lands in the layer, and its drafts are the pushed layer's."""
    from rlx.rollout.engines.embedded.mtp import MTPDraft
    from rlx.rollout.engines.embedded.weights import load_named, served_state

    _, model, _ = served
    draft = MTPDraft(model)
    n = model.config.num_hidden_layers
    names = [f"model.layers.{n}.mlp.experts.0.gate_proj.weight", f"model.layers.{n}.self_attn.o_proj.weight",
             f"model.layers.{n}.eh_proj.weight"]
    state = served_state(model)
    before = {k: state[k].clone() for k in names}
    tokens, hidden = torch.tensor([[5, 6, 7]]), torch.randn(1, 3, model.config.hidden_size)
    mask, positions = torch.ones(1, 3, dtype=torch.long), torch.arange(3)[None]
    logits0 = draft(tokens, hidden, mask, positions, None)[1]
    try:
        load_named(model, [(k, v + 0.5) for k, v in before.items()])
        layer = served_state(draft.layer, held=False)
        assert torch.equal(layer["mlp.experts.0.gate_proj.weight"], before[names[0]] + 0.5)
        assert torch.equal(layer["self_attn.o_proj.weight"], before[names[1]] + 0.5)
        assert not torch.allclose(draft(tokens, hidden, mask, positions, None)[1], logits0)
    finally:
        load_named(model, list(before.items()))
    assert torch.allclose(draft(tokens, hidden, mask, positions, None)[1], logits0)


def test_mtp_drafts_in_bf16_as_on_a_gpu(served):
    """The engine's precision on a GPU: the MTP layer, its held tensors and the hidden states it takes are bf16."""
    from rlx.models.load import load_lm
    from rlx.rollout.engines.embedded.sampling import SamplingParams
    from rlx.rollout.engines.embedded.weights import name_as_checkpoint
    from rlx.testing.runs import decode

    path, _, tok = served
    model = load_lm(path, torch.bfloat16).eval()
    name_as_checkpoint(model, path)
    reqs, s, _ = decode(model, tok, [[5, 6, 7, 8] * 4] * 3, SamplingParams(max_new_tokens=12, ignore_eos=True),
                        speculative=3, mtp=True)
    assert all(r.finish_reason["type"] == "length" and len(r.output_ids) == 12 for r in reqs), reqs[0].finish_reason
    assert s.spec_verify_ct > 0 and s.mtp.layer.self_attn.o_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_quantised_rollout_of_a_checkpoint_with_an_mtp_layer(served, tmp_path, kind):
    """``--quantization fp8|int4`` on DeepSeek-V3 as published (every release has an MTP layer): the model's weights are
    served quantised, the MTP layer the engine holds beside it stays dequantised, as its drafts compute with it (a run
    that trains it with quantised rollout is refused at preflight)."""
    from rlx.models.fp8 import write_quantized
    from rlx.models.load import load_lm
    from rlx.rollout.engines.embedded.weights import name_as_checkpoint, serve_quantized

    path = write_quantized(served[0], tmp_path / "fp8", (16, 16)) if kind == "fp8" else served[0]
    model = load_lm(str(path), torch.float32).eval()
    name_as_checkpoint(model, path)
    serve_quantized(model, kind, path)
    n = model.config.num_hidden_layers
    names, _, _ = model.rlx_quantized
    assert "model.layers.0.self_attn.o_proj.weight" in names and not any(k.startswith(f"model.layers.{n}.")
                                                                         for k in names)
    assert model.rlx_held[f"model.layers.{n}.self_attn.o_proj.weight"].dtype == torch.float32
