"""MiniMax-M2 under megatron on CPU (gloo, torchrun): tensor parallelism (the full-width q/k norms all-reduce their
statistics over the group, forward and backward), expert parallelism and both together train exactly like one
process; and `rl train` on the tiny model pushes by the published names (every tensor verified on the engine) and
exports a checkpoint transformers loads."""

import pytest

from rlx.testing.parallel import assert_same, run
from rlx.testing.runs import train_and_export

pytestmark = pytest.mark.integration

MODEL = "builtin://tiny-minimax-m2"
KEYS = ("loss", "pg_loss", "entropy", "kl", "samples", "tokens", "moe/aux_loss", "moe/load_max_mean")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), MODEL, 1)


@pytest.mark.parametrize("nproc,tp,pp,ep", [(2, 2, 1, 1), (2, 1, 1, 2), (4, 2, 1, 2)], ids=["tp2", "ep2", "tp2-ep2"])
def test_parallel_matches_one_process(single, tmp_path, nproc, tp, pp, ep):
    assert_same(run(tmp_path, MODEL, nproc, tp, pp, ep), single, KEYS)


def test_rl_train_pushes_by_the_published_names_and_exports(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = train_and_export(tmp_path, MODEL)
    assert len(out["rows"]) == 3 and max(r["train_rollout_logprob_diff"] for r in out["rows"]) < 1e-4
    after, before = out["after"], out["before"]
    assert set(after) == set(before)
    name = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    assert not torch.equal(after[name], before[name])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj[5], after[name])
