"""GLM-4.5 under megatron on CPU (gloo, torchrun): expert, pipeline and tensor×expert parallelism train exactly like
one process (tensor parallelism alone is the same code as Qwen3-MoE's, tested there), with shared experts beside the routed ones, a dense first layer, and the aux-loss-free correction bias
updated after every optimizer step (it is in the exported weights); and rollout routing replay through the grouped
sigmoid router."""

import pytest

from rlx.testing.parallel import assert_same, run

pytestmark = pytest.mark.integration

MODEL = "builtin://tiny-glm4-moe"
KEYS = ("loss", "pg_loss", "entropy", "kl", "samples", "tokens", "moe/aux_loss", "moe/load_max_mean")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), MODEL, 1)


@pytest.mark.parametrize("nproc,tp,pp,ep", [(2, 1, 1, 2), (2, 1, 2, 1), (4, 2, 1, 2)], ids=["ep2", "pp2", "tp2-ep2"])
def test_parallel_matches_one_process(single, tmp_path, nproc, tp, pp, ep):
    assert_same(run(tmp_path, MODEL, nproc, tp, pp, ep), single, KEYS)


def test_the_correction_bias_is_balanced_after_each_step(single):
    """megatron's aux-loss-free balancing moves each expert's bias by the update rate (1e-3) toward balance every
    optimizer step (two per training step here), and the pushed/exported weights carry it."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from rlx.models.tiny import resolve_model_path

    before = load_file(str(next(Path(resolve_model_path(MODEL)).glob("*.safetensors"))))
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    moved = torch.tensor(single["weights"][name]) - before[name]
    assert moved.abs().max() > 0
    assert torch.allclose(moved, (moved / 1e-3).round() * 1e-3, atol=1e-6)  # whole steps of the update rate
    assert (moved.abs() <= 4e-3 + 1e-6).all()  # at most 4 updates


def test_routing_replay_through_the_grouped_sigmoid_router(tmp_path):
    off, on = run(tmp_path, MODEL, 1, replay="off"), run(tmp_path, MODEL, 1, replay="on")
    assert off["m1"]["moe/routing_agreement"] < 0.99 and on["m1"]["moe/routing_agreement"] == 1.0
    assert on["m1"]["train_rollout_logprob_diff"] < off["m1"]["train_rollout_logprob_diff"]
