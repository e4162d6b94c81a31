"""Qwen3-Next under megatron on CPU (gloo, torchrun): tensor parallelism trains exactly like one process (the same
losses and updated weights within 1e-5), with each rank holding its own GDN key heads (in_proj rows, convolution
channels, decay and gate parameters) and its own attention query groups."""

import pytest

from rlx.testing.parallel import assert_same, run

pytestmark = pytest.mark.integration

MODEL = "builtin://tiny-qwen3-next"


def test_tensor_parallel_matches_one_process(tmp_path):
    single = run(tmp_path, MODEL, 1)
    got = run(tmp_path, MODEL, 2, tp=2)
    assert_same(got, single, ("loss", "pg_loss", "entropy", "kl", "samples", "tokens"))
    assert single["m2"]["kl"] > 0 and single["m1"]["loss"] != single["m2"]["loss"]  # the model did move
    names = set(single["weights"])
    assert {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.A_log",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight"} <= names
