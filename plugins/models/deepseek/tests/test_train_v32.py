"""`rl train` on the tiny DeepSeek-V3.2 (``deepseek_v32``: sparse attention in every layer): the embedded engine
(transformers' DeepSeek-V3.2) serves what the trainer holds, the indexer comes back unchanged; TP=2 and PP=2 train as
one process does."""

import pytest

from rlx.testing.parallel import assert_same, run
from rlx.testing.runs import train_and_export

pytestmark = pytest.mark.integration

def engine_follows(rows):
    """The engine's log-probs are the trainer's (fp32): within 1e-4 on most steps. A query whose k-th and (k+1)-th
    keys score within rounding of each other may keep another key in the engine (its rows and positions laid out
    otherwise than the trainer's packed rows), which moves a step's mean by up to ~1e-3."""
    diffs = sorted(r["train_rollout_logprob_diff"] for r in rows)
    return diffs[len(diffs) // 2] < 1e-4 and diffs[-1] < 1e-2


MODEL = "builtin://tiny-deepseek-v3.2"
KEYS = ("loss", "pg_loss", "entropy", "kl", "samples", "tokens", "moe/aux_loss", "moe/load_max_mean")


def test_rl_train_keeps_the_indexer_and_trains_the_rest(tmp_path):
    import torch

    out = train_and_export(tmp_path, MODEL)
    rows, before, after = out["rows"], out["before"], out["after"]
    assert len(rows) == 3 and engine_follows(rows)
    assert set(after) == set(before)
    indexer = [n for n in before if ".indexer." in n]
    assert len(indexer) == 4 * 5 and all(torch.equal(after[n], before[n]) for n in indexer)


@pytest.mark.parametrize("nproc,tp,pp", [(2, 2, 1), (2, 1, 2)], ids=["tp2", "pp2"])
def test_parallel_matches_one_process(tmp_path, nproc, tp, pp):
    (tmp_path / "one").mkdir()
    assert_same(run(tmp_path, MODEL, nproc, tp, pp), run(tmp_path / "one", MODEL, 1), KEYS)
