"""`rl train` on the tiny GLM-5 (``glm_moe_dsa``: latent attention with DeepSeek sparse attention): the embedded engine
(transformers' GLM-5, its indexer selecting with the same frozen weights) serves what the trainer holds, every pushed
tensor is verified, the indexer's weights come back unchanged and the rest trained; TP=2 and EP=2 train as one
process does."""

import pytest

from rlx.testing.parallel import assert_same, run
from rlx.testing.runs import sparse_engine_follows, train_and_export

pytestmark = pytest.mark.integration

MODEL = "builtin://tiny-glm5"
KEYS = ("loss", "pg_loss", "entropy", "kl", "samples", "tokens", "moe/aux_loss", "moe/load_max_mean")


def test_rl_train_keeps_the_indexer_and_trains_the_rest(tmp_path):
    import torch

    out = train_and_export(tmp_path, MODEL)
    rows, before, after = out["rows"], out["before"], out["after"]
    assert len(rows) == 3 and sparse_engine_follows(rows)
    assert set(after) == set(before)
    indexer = [n for n in before if ".indexer." in n]
    assert indexer and all(torch.equal(after[n], before[n]) for n in indexer)
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    assert not torch.equal(after[name], before[name])


def test_with_indexer_kl_coef_the_indexer_trains_and_the_engines_follow(tmp_path):
    """``train.objective.indexer_kl_coef``: the indexers move toward the attention's distribution, their new weights
    reach the engine (its log-probs still the trainer's) and the export."""
    import torch

    out = train_and_export(tmp_path, MODEL, 3, "train.objective.indexer_kl_coef=1.0")
    rows, before, after = out["rows"], out["before"], out["after"]
    assert len(rows) == 3 and sparse_engine_follows(rows)
    for layer in (0, 2):  # the full layers (1 and 3 reuse their selection and have no indexer)
        name = f"model.layers.{layer}.self_attn.indexer.wq_b.weight"
        assert not torch.equal(after[name], before[name]), name


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), MODEL, 1)


@pytest.mark.parametrize("nproc,tp,pp,ep", [(2, 2, 1, 1), (2, 1, 2, 1), (4, 2, 1, 2)], ids=["tp2", "pp2", "tp2-ep2"])
def test_parallel_matches_one_process(single, tmp_path, nproc, tp, pp, ep):
    """(PP=2: the second stage starts at layer 2, a full indexer layer. TP=2 x EP=2 is also data parallel: its samples
    pack into other rows; the selection must not depend on that.)"""
    assert_same(run(tmp_path, MODEL, nproc, tp, pp, ep), single, KEYS)
