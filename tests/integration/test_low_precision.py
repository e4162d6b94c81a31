"""Low-precision rollout (``rollout.quantization``) and speculative decoding: `rl train` with engines that serve FP8 (block-quantised e4m3,
128x128 scales; the embedded engine holds them as pushed and computes with them dequantised), every push quantised on
the trainer's side and verified on the engine."""

import json
import math

import pytest

from rlx.testing.runs import train_and_export

pytestmark = pytest.mark.integration


def test_fp8_rollout_pushes_quantised_weights_and_reports_the_mismatch_they_cause(tmp_path):
    from rlx.models.fp8 import QUANTISED

    run = train_and_export(tmp_path, "builtin://tiny-qwen3", 3, "rollout.quantization=fp8")
    rows, after = run["rows"], run["after"]
    [copy] = (tmp_path / "run").glob("model-fp8-*")  # what the engine was launched from
    assert json.loads((copy / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    # the engine samples from the quantised policy: its log-probs differ from the trainer's, a little (the
    # full-precision rollout's difference is below 1e-6)
    assert all(1e-4 < r["train_rollout_logprob_diff"] < 0.05 for r in rows)
    # a push: each projection's bytes (1 each) and its scales, the rest as the trainer holds it (fp32)
    pushed = sum(t.numel() + 4 * math.ceil(t.shape[0] / 128) * math.ceil(t.shape[1] / 128) if QUANTISED.match(n)
                 else 4 * t.numel() for n, t in after.items())
    assert all(r["weight_sync/bytes"] == pushed for r in rows)
    assert pushed < 0.5 * sum(4 * t.numel() for t in after.values())


def test_int4_rollout_and_quantisation_aware_training(tmp_path):
    """``rollout.quantization: int4`` (weight-only, groups of 128): the engine samples from the INT4 policy, a quarter
    of a bf16 push's bytes travel; with ``train.qat: int4`` the trainer's forward computes with the weights the
    engine holds, so their log-probs agree as in full precision again, while the optimizer moves the full-precision
    weights (every pushed INT4 weight verified on the engine, both runs)."""
    import torch

    from rlx.models.fp8 import QUANTISED

    plain = train_and_export(tmp_path / "int4", "builtin://tiny-qwen3", 3, "rollout.quantization=int4")
    qat = train_and_export(tmp_path / "qat", "builtin://tiny-qwen3", 3, "rollout.quantization=int4", "train.qat=int4")
    assert all(r["train_rollout_logprob_diff"] > 1e-3 for r in plain["rows"])
    assert all(r["train_rollout_logprob_diff"] < 1e-5 for r in qat["rows"])
    pushed = sum(math.ceil(t.shape[1] / 2) * t.shape[0] + 4 * t.shape[0] * math.ceil(t.shape[1] / 128)
                 if QUANTISED.match(n) else 4 * t.numel() for n, t in qat["after"].items())
    assert all(r["weight_sync/bytes"] == pushed for r in qat["rows"])
    name = "model.layers.0.mlp.down_proj.weight"
    before, after = qat["before"][name], qat["after"][name]
    assert not torch.equal(after, before) and (after - before).abs().max() < 0.1  # trained, not quantised


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_in_rl_train(tmp_path, method):
    """``rollout.engines[*].speculative`` on the quickstart's model, 32 tokens past its answer (ignore_eos), where it
    repeats itself: n-gram drafts, or drafts from the model the run starts from (not trained, as SGLang's STANDALONE
    drafts are not); the engine verifies them each step. The log-probs it returns are the policy's (the trainer's within the full-precision
    tolerance), and each step reports the drafts' acceptance and the tokens per verify step, as SGLang counts them,
    beside the rollout's tokens per second."""
    draft = ["rollout.engines.0.speculative.draft_model=builtin://tiny-qwen3-arith"] if method == "draft_model" else []
    run = train_and_export(tmp_path, "builtin://tiny-qwen3-arith", 3, f"rollout.engines.0.speculative.method={method}",
                           *draft, "rollout.engines.0.speculative.num_draft_tokens=3",
                           "rollout.sampling.max_new_tokens=32", "rollout.sampling.ignore_eos=true")
    for r in run["rows"]:
        assert r["train_rollout_logprob_diff"] < 1e-5
        assert 0 < r["rollout/spec_accept_rate"] <= 1 and r["rollout/spec_accept_length"] > 1, r
        assert r["time/rollout_tokens_per_s"] > 0
