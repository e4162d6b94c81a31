"""Each advantage estimator, policy loss, KL estimator and normalisation against values worked out
by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from rlx.config import component_config
from rlx.plugins import build_plugins
from rlx.train.advantages import grpo_advantages, reinforce_pp_baseline_advantages, token_weights
from rlx.train.losses import ClipConfig, gspo_loss, kl_penalty, ppo_clip_loss, tis_weights
from rlx.config import ObjectiveConfig
from rlx.train.objective import LossInputs, metric_keys, objective
from rlx.types import Group, Sample, SampleStatus

T = torch.tensor


def group(gid, rewards, masks=None, first_id=0):
    masks = masks or [[1]] * len(rewards)
    return Group(gid, [Sample([0], [1] * len(m), loss_mask=m, reward=r, status=SampleStatus.COMPLETED,
                              sample_id=first_id + i, group_id=gid) for i, (r, m) in enumerate(zip(rewards, masks))])


def test_grpo_advantages_with_and_without_std():
    g = [group(0, [1.0, 0.0, 0.0, 1.0]), group(1, [3.0, 3.0], first_id=4)]
    # mean 0.5, population std 0.5 -> +-1; an all-equal group gets 0
    assert list(grpo_advantages(g).values()) == pytest.approx([1, -1, -1, 1, 0, 0], abs=1e-5)
    assert list(grpo_advantages(g, normalize_std=False).values()) == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]


def test_grpo_skips_failed_samples():
    g = group(0, [1.0, 0.0, 5.0])
    g.samples[2].status = SampleStatus.FAILED
    assert set(grpo_advantages([g])) == {0, 1}


def test_reinforce_pp_baseline_then_batch_whitening():
    # centred: [0.5, -0.5] and [-1, -1, 2]; batch mean 0, std sqrt(6.5 / 5) = 1.140175
    # (one token per sample here, so per-token whitening equals per-sample whitening)
    adv = reinforce_pp_baseline_advantages([group(0, [1.0, 0.0]), group(1, [2.0, 2.0, 5.0], first_id=2)])
    s = math.sqrt(1.3)
    assert [a[0] for a in adv.values()] == pytest.approx([0.5 / s, -0.5 / s, -1 / s, -1 / s, 2 / s], abs=1e-5)


def test_token_sequence_and_group_normalisation():
    groups = [group(0, [1.0, 0.0], masks=[[1, 1, 1], [0, 1]]), group(1, [1.0], masks=[[1, 1]], first_id=2)]
    assert token_weights(groups, "token") == pytest.approx({0: 1 / 6, 1: 1 / 6, 2: 1 / 6})
    assert token_weights(groups, "sequence") == pytest.approx({0: 1 / 9, 1: 1 / 3, 2: 1 / 6})
    # two groups; group 0 has two samples sharing its half: 1/(2*2*3), 1/(2*2*1); group 1: 1/(2*1*2)
    w = token_weights(groups, "group")
    assert w == pytest.approx({0: 1 / 12, 1: 1 / 4, 2: 1 / 4})
    assert 3 * w[0] + 1 * w[1] + 2 * w[2] == pytest.approx(1.0)


def test_ppo_clip_with_clip_higher():
    logp = torch.log(T([1.5, 0.5, 1.1]))
    loss, clipped = ppo_clip_loss(logp, torch.zeros(3), T([1.0, -1.0, 2.0]), ClipConfig(0.2, 0.28))
    # r=1.5,A=1: max(-1.5, -1.28); r=0.5,A=-1: max(0.5, 0.8); r=1.1,A=2: -2.2 either way
    assert loss.tolist() == pytest.approx([-1.28, 0.8, -2.2])
    assert clipped.tolist() == [True, True, False]


def test_dual_clip_caps_negative_advantages():
    loss, _ = ppo_clip_loss(torch.log(T([5.0, 5.0])), torch.zeros(2), T([-1.0, 1.0]), ClipConfig(0.2, 0.2, 3.0))
    # A=-1, r=5: max(5, 1.2) = 5, capped at 3; A=+1 unaffected: max(-5, -1.2) = -1.2
    assert loss.tolist() == pytest.approx([3.0, -1.2])


def test_gspo_uses_one_ratio_per_sequence_and_its_gradient():
    logp = T([0.1, 0.3, -0.5], requires_grad=True)
    loss, _ = gspo_loss(logp, torch.zeros(3), T([1.0, 1.0, -1.0]), torch.tensor([0, 0, 1]), torch.ones(3),
                        ClipConfig(0.2, 0.28))
    s0, s1 = math.exp(0.2), math.exp(-0.5)  # geometric means: exp(mean(0.1, 0.3)), exp(-0.5)
    assert loss.tolist() == pytest.approx([-s0, -s0, 0.8])  # s1 = 0.607 clipped up to 0.8
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-s0, -s0, 0.0])  # clipped token: no gradient
    assert s1 < 0.8


def test_kl_estimators():
    logp, ref = T([-1.0]), T([-2.0])  # log ratio 1
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-1))
    assert kl_penalty(T([0.0]), T([-30.0]), "low_var").item() == pytest.approx(10.0)


def test_tis_weights_cap_or_mask():
    assert tis_weights(T([3.0, 0.5]), cap=2.0).tolist() == pytest.approx([2.0, 0.5])
    # masked: a ratio above the cap drops the token, one below keeps its ratio
    assert tis_weights(T([3.0, 0.5]), cap=2.0, mode="mask").tolist() == pytest.approx([0.0, 0.5])


def test_objective_combines_terms_with_weights():
    policy = build_plugins(entry_points=False).build("losses", {"name": "ppo_clip",
                                                                "args": {"eps_low": 0.2, "eps_high": 0.2}})
    logp = T([math.log(1.0), math.log(1.0)], requires_grad=True)
    inp = LossInputs(logprobs=logp, old_logprobs=torch.zeros(2), rollout_logprobs=T([0.0, -math.log(3.0)]),
                     advantages=T([1.0, -1.0]), weights=T([0.25, 0.75]), mask=torch.ones(2),
                     seq_index=torch.tensor([0, 1]), ref_logprobs=T([-1.0, 0.0]), entropy=T([2.0, 1.0]))
    loss, m = objective(inp, policy, ObjectiveConfig(kl_coef=0.5, kl_type="k1", entropy_coef=0.1, tis_cap=2.0))
    # pg per token: -1 and +1; tis: 1 and min(3, 2) = 2 -> weighted: -0.25 + 0.75*2 = 1.25
    # kl k1: [1, 0] weighted 0.25; entropy weighted 0.25*2 + 0.75*1 = 1.25
    assert m["pg_loss"] == pytest.approx(1.25) and m["kl"] == pytest.approx(0.25)
    assert m["entropy"] == pytest.approx(1.25)
    assert loss.item() == pytest.approx(1.25 + 0.5 * 0.25 - 0.1 * 1.25)
    assert set(m) == set(metric_keys(kl=True, entropy=True))  # what every pipeline stage reduces
    # masked importance sampling: the second token's ratio 3 is over the cap, so it drops out
    _, m = objective(inp, policy, ObjectiveConfig(tis_cap=2.0, tis_mode="mask"))
    assert m["pg_loss"] == pytest.approx(-0.25) and m["tis_masked"] == pytest.approx(0.75)


def test_loss_components_are_registered_with_their_configs():
    p = build_plugins(entry_points=False)
    assert {"ppo_clip", "gspo"} <= set(p.names("losses")) and {"grpo", "reinforce_pp"} <= set(p.names("advantages"))
    assert component_config(p.get("losses", "gspo"), {}).eps_high == 4e-4
    grpo = p.build("advantages", {"name": "grpo", "args": {"normalize_std": False}})
    assert list(grpo.advantages([group(0, [1.0, 0.0])]).values()) == [0.5, -0.5]


def test_branches_of_one_trajectory_count_once():
    # trajectory A (reward 1) branched into samples 0 and 1 (2 and 1 tokens); B (reward 0) is sample 2 (2 tokens)
    g = group(0, [1.0, 1.0, 0.0], masks=[[1, 1], [1], [1, 1]])
    g.samples[0].trajectory_id = g.samples[1].trajectory_id = 0
    # over trajectories: mean 0.5, std 0.5 -> A's samples +1 each, B -1 (not a 3-sample mean of 2/3)
    assert grpo_advantages([g]) == pytest.approx({0: 1.0, 1: 1.0, 2: -1.0}, abs=1e-5)
    # group norm: each trajectory gets half the group; A's half spread over its 3 tokens, B's over 2
    assert token_weights([g], "group") == pytest.approx({0: 1 / 6, 1: 1 / 6, 2: 1 / 4})
    assert token_weights([g], "sequence") == pytest.approx({0: 1 / 6, 1: 1 / 6, 2: 1 / 4})


def test_prepare_spreads_scalar_advantages_of_any_numeric_type_and_checks_per_token_lengths():
    import numpy as np

    from rlx.errors import RLXError
    from rlx.train.step import prepare
    from rlx.types import RolloutBatch

    g = group(0, [1.0, 0.0], masks=[[1, 1, 0], [1]])  # ragged, with a tool token
    n = [len(s.response_ids) for s in g.samples]

    class Mixed:
        name = "mixed"

        def advantages(self, groups):
            a, b = groups[0].samples
            return {a.sample_id: np.float32(0.5), b.sample_id: torch.tensor(-0.5)}

    tb = prepare(RolloutBatch(1, [g]), Mixed(), "token")
    assert tb.tokens(g.samples, "advantages").tolist() == [0.5] * n[0] + [-0.5] * n[1]
    # token-mean weights: every loss-masked token of the batch counts 1 / total
    total = sum(sum(s.loss_mask) for s in g.samples)
    assert tb.tokens(g.samples, "weights").tolist() == pytest.approx(
        [m / total for s in g.samples for m in s.loss_mask])

    class Short:
        name = "short"

        def advantages(self, groups):
            return {s.sample_id: [1.0] for s in groups[0].samples}

    with pytest.raises(RLXError, match="estimator 'short' gave sample 0 1 advantages for 3 response tokens"):
        prepare(RolloutBatch(1, [g]), Short(), "token")


def test_multi_lora_advantages_and_normalisation_are_each_adapters_own():
    """Multi-LoRA (``multi``): the estimator sees each adapter's groups as a batch of their own (a batch statistic, such
    as REINFORCE++'s whitening, never mixes two adapters' rewards), and each adapter's loss is the mean over its own
    loss-masked tokens (token norm: adapter a's 6 tokens 1/6 each, b's one token 1); without ``multi`` the batch is
    one (1/7 each); a sample of no adapter is refused."""
    from rlx.errors import RLXError
    from rlx.train.step import prepare
    from rlx.types import RolloutBatch

    groups = [group(0, [1.0, 0.0], masks=[[1, 1, 1], [0, 1]]), group(1, [2.0], masks=[[1]], first_id=2),
              group(2, [0.0, 1.0], masks=[[1], [1]], first_id=3)]
    for g, lora in zip(groups, ["a", "b", "a"]):
        for x in g.samples:
            x.lora = lora
    calls = []

    class Seen:
        name = "seen"

        def advantages(self, gs):
            calls.append([g.group_id for g in gs])
            return {x.sample_id: 1.0 for g in gs for x in g.samples}

    tb = prepare(RolloutBatch(1, groups), Seen(), "token", multi=True)
    assert calls == [[0, 2], [1]]
    samples = [x for g in groups for x in g.samples]
    assert tb.tokens(samples, "weights").tolist() == pytest.approx(
        [1 / 6, 1 / 6, 1 / 6, 0, 1 / 6] + [1.0] + [1 / 6, 1 / 6])
    plain = prepare(RolloutBatch(1, groups), Seen(), "token")
    assert calls[-1] == [0, 1, 2] and plain.tokens(samples, "weights").tolist() == pytest.approx(
        [1 / 7, 1 / 7, 1 / 7, 0, 1 / 7] + [1 / 7] + [1 / 7, 1 / 7])
    groups[1].samples[0].lora = None
    with pytest.raises(RLXError, match="a sample without an adapter"):
        prepare(RolloutBatch(1, groups), Seen(), "token", multi=True)


def test_response_logprobs_and_entropy_of_the_tempered_distribution():
    """Log-probs and entropy of softmax(logits / temperature) at the response positions, against a direct
    computation. (rlx used to take the entropy from the logits after megatron's cross entropy had turned them
    into probabilities in place: the entropy metric and, with an entropy coefficient, its gradient were wrong.)
    The entropy carries a gradient only when it is a loss term."""
    from rlx.train.objective import response_logprobs
    from rlx.train.packing import pack
    from rlx.types import Sample

    a = Sample([1, 2], [3, 4, 5], sample_id=0, token_temperatures=[0.6, 0.6, 0.6])
    b = Sample([6], [7, 8], sample_id=1)  # no temperatures recorded: 1.0
    mb = pack([a, b])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, mb.input_ids.shape[1], 11, generator=g, requires_grad=True)
    rows = logits[0, [1, 2, 3, 5, 6]]  # the positions predicting 3, 4, 5 | 7, 8
    temps = torch.tensor([0.6, 0.6, 0.6, 1.0, 1.0])[:, None]
    want_lp = torch.log_softmax(rows / temps, -1)[range(5), [3, 4, 5, 7, 8]]
    p = torch.softmax(rows / temps, -1)
    want_ent = -(p * p.log()).sum(-1)
    lp, ent = response_logprobs(mb, logits, entropy=True)
    assert torch.allclose(lp, want_lp, atol=1e-6) and torch.allclose(ent, want_ent, atol=1e-5)
    assert lp.requires_grad and not ent.requires_grad  # a metric: no graph
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    (want,) = torch.autograd.grad(want_lp.sum(), logits, retain_graph=True)
    assert torch.allclose(grad, want, atol=1e-6)
    _, ent = response_logprobs(mb, logits, entropy=True, entropy_grad=True)
    (grad,) = torch.autograd.grad(ent.sum(), logits)
    (want,) = torch.autograd.grad(want_ent.sum(), logits)
    assert torch.allclose(grad, want, atol=1e-5)
