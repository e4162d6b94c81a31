"""`rl train` on the tiny DeepSeek-V3.2 (``deepseek_v32``: sparse attention in every layer): the embedded engine
(transformers' DeepSeek-V3.2) serves what the trainer holds, the indexer comes back unchanged; TP=2 and PP=2 train as
one process does."""

import pytest

from rlx.testing.parallel import assert_same, run
from rlx.testing.runs import sparse_engine_follows, train_and_export

pytestmark = pytest.mark.integration

MODEL = "builtin://tiny-deepseek-v3.2"
KEYS = ("loss", "pg_loss", "entropy", "kl", "samples", "tokens", "moe/aux_loss", "moe/load_max_mean")


def test_rl_train_keeps_the_indexer_and_trains_the_rest(tmp_path):
    import torch

    out = train_and_export(tmp_path, MODEL)
    rows, before, after = out["rows"], out["before"], out["after"]
    assert len(rows) == 3 and sparse_engine_follows(rows)
    assert set(after) == set(before)
    indexer = [n for n in before if ".indexer." in n]
    assert len(indexer) == 4 * 5 and all(torch.equal(after[n], before[n]) for n in indexer)


@pytest.mark.parametrize("nproc,tp,pp", [(2, 2, 1), (2, 1, 2)], ids=["tp2", "pp2"])
def test_parallel_matches_one_process(tmp_path, nproc, tp, pp):
    (tmp_path / "one").mkdir()
    assert_same(run(tmp_path, MODEL, nproc, tp, pp), run(tmp_path / "one", MODEL, 1), KEYS)
