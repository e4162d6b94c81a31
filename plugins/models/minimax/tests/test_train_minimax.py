"""`rl train` on the tiny MiniMax-M2 with INT4 rollout and quantisation-aware training: its Mixtral-named experts
(``block_sparse_moe.experts.{e}.w1/w2/w3``) are quantised on the engine's side exactly where the trainer fake-quantises
megatron's expert projections, so their log-probs agree as in full precision (every pushed INT4 weight verified)."""

import pytest

from rlx.testing.runs import train_and_export

pytestmark = pytest.mark.integration


def test_int4_qat_quantises_the_mixtral_named_experts_as_the_engine_does(tmp_path):
    run = train_and_export(tmp_path, "builtin://tiny-minimax-m2", 2, "rollout.quantization=int4", "train.qat=int4")
    assert all(r["train_rollout_logprob_diff"] < 1e-5 for r in run["rows"])
    assert any(n.endswith("experts.0.w1.weight") for n in run["after"])
