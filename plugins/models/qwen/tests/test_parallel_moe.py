"""Qwen3-MoE under megatron on CPU (gloo, torchrun): tensor, expert and pipeline parallelism each train exactly like
one process (the same losses, router metrics and updated weights within 1e-5), with the alltoall token dispatcher
moving tokens between expert-parallel ranks and the HF weights gathered from every rank that holds experts; and
rollout routing replay, alone and under those layouts."""

import pytest

from rlx.testing.parallel import assert_same, run

pytestmark = pytest.mark.integration

MODEL = "builtin://tiny-qwen3-moe"
KEYS = ("loss", "pg_loss", "entropy", "kl", "samples", "tokens")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), MODEL, 1)


# TP=2 runs as part of TP2×EP2 (expert tensor parallelism = TP): the suite's time goes to layouts that add code paths
@pytest.mark.parametrize("nproc,tp,pp,ep", [(2, 1, 1, 2), (2, 1, 2, 1), (4, 2, 1, 2)], ids=["ep2", "pp2", "tp2-ep2"])
def test_parallel_matches_one_process(single, tmp_path, nproc, tp, pp, ep):
    got = run(tmp_path, MODEL, nproc, tp, pp, ep)
    moe = sorted(k for k in single["m1"] if k.startswith("moe/"))
    assert moe == ["moe/aux_loss", "moe/layer0/load_max_mean", "moe/layer1/load_max_mean", "moe/load_max_mean",
                   "moe/tokens_dropped"]
    assert_same(got, single, KEYS + tuple(moe))  # routing statistics count every token once, whatever the layout
    assert single["m1"]["moe/aux_loss"] > 1 and single["m1"]["moe/tokens_dropped"] == 0
    assert single["m2"]["kl"] > 0 and single["m1"]["loss"] != single["m2"]["loss"]  # the model did move
    assert any(".mlp.experts.7.down_proj" in n for n in single["weights"])  # every expert, by its HF name


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("r3")
    return run(folder, MODEL, 1, replay="off"), run(folder, MODEL, 1, replay="on")


def test_routing_replay_makes_the_trainer_route_as_the_engine_did(replayed):
    """An engine whose routers were perturbed: without replay the trainer picks other experts for part of the
    tokens and its log-probs drift from the engine's; with replay it uses the engine's experts for every token
    (agreement 1) and the log-prob difference shrinks."""
    off, on = replayed
    m_off, m_on = off["m1"], on["m1"]
    assert 0.2 < m_off["moe/natural_agreement"] < 0.99
    assert m_off["moe/routing_agreement"] == m_off["moe/natural_agreement"]  # no replay: it used its own choice
    assert m_on["moe/routing_agreement"] == 1.0 and m_on["moe/natural_agreement"] < 0.99
    assert m_on["train_rollout_logprob_diff"] < 0.5 * m_off["train_rollout_logprob_diff"]
    print(f"R3: routing agreement {m_off['moe/routing_agreement']:.3f} -> {m_on['moe/routing_agreement']:.3f}, "
          f"train_rollout_logprob_diff {m_off['train_rollout_logprob_diff']:.2e} -> "
          f"{m_on['train_rollout_logprob_diff']:.2e}")


@pytest.mark.parametrize("nproc,tp,pp,ep", [(2, 1, 2, 1), (4, 2, 1, 2)], ids=["pp2", "tp2-ep2"])
def test_routing_replay_under_parallelism_matches_one_process(replayed, tmp_path, nproc, tp, pp, ep):
    """Replay cut to each tensor-parallel rank's part of the sequence, to each pipeline stage's layers, and with
    tokens dispatched over expert-parallel ranks, trains as one process does (a reference model is present)."""
    got = run(tmp_path, MODEL, nproc, tp, pp, ep, replay="on")
    assert_same(got, replayed[1], ("loss", "kl", "entropy", "train_rollout_logprob_diff", "moe/routing_agreement",
                                   "moe/natural_agreement"))
