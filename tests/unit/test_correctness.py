"""Training correctness: every estimator, normalisation, loss and correction against values computed by
hand from its paper's formula, with ragged lengths, all-masked samples, fan-out and missing log-probs."""

import math

import pytest
import torch

from rlx.config import ObjectiveConfig
from rlx.errors import RLXError
from rlx.train.advantages import (grpo_advantages, reinforce_pp_advantages, reinforce_pp_baseline_advantages,
                                  token_weights)
from rlx.train.losses import ClipConfig, cispo_loss, importance_ratio, kl_penalty, tis_weights
from rlx.train.objective import LossInputs, objective
from rlx.types import Group, Sample, SampleStatus

T = torch.tensor


def sample(sid, reward, mask, gid=0, traj=None):
    return Sample([1, 2], list(range(10, 10 + len(mask))), list(mask), [-1.0] * len(mask), reward=reward,
                  status=SampleStatus.COMPLETED, sample_id=sid, group_id=gid, trajectory_id=traj)


# -- normalisation -------------------------------------------------------------------------------------


def test_token_mean_counts_only_loss_masked_tokens_of_the_batch():
    # 2 + 0 + 1 loss-masked tokens: the all-masked sample adds no phantom token (the old code made it 4)
    g = Group(0, [sample(0, 1.0, [1, 1, 0]), sample(1, 0.0, [0, 0]), sample(2, 0.5, [1])])
    w = token_weights([g], "token")
    assert w[0] == w[2] == pytest.approx(1 / 3)  # per loss-masked token
    assert sum(w[s.sample_id] * sum(s.loss_mask) for s in g.samples) == pytest.approx(1.0)


def test_sequence_and_group_means_skip_trajectories_without_loss_tokens():
    a = Group(0, [sample(0, 1.0, [1, 1]), sample(1, 0.0, [0, 0, 0])])
    b = Group(1, [sample(2, 1.0, [1])])
    # sequence: two trajectories with tokens, 1/2 each, shared by their tokens
    assert token_weights([a, b], "sequence") == {0: pytest.approx(0.25), 1: 0.0, 2: pytest.approx(0.5)}
    # group: two live groups, 1/2 each; group a has one live trajectory of two tokens
    assert token_weights([a, b], "group") == {0: pytest.approx(0.25), 1: 0.0, 2: pytest.approx(0.5)}


def test_a_trajectory_branched_into_samples_counts_once_in_sequence_mean():
    # trajectory 7 branched into samples 0 (2 tokens) and 1 (1 token); sample 2 is its own trajectory
    g = Group(0, [sample(0, 1.0, [1, 1], traj=7), sample(1, 1.0, [1], traj=7), sample(2, 0.0, [1, 0, 1])])
    w = token_weights([g], "sequence")
    assert w[0] == w[1] == pytest.approx(0.5 / 3) and w[2] == pytest.approx(0.5 / 2)


def test_token_weights_add_up_to_one_however_the_batch_is_cut_into_micro_batches():
    from rlx.train.packing import micro_batches, pack

    samples = [sample(i, float(i % 2), [1] * (2 + i % 5) + [0] * (i % 3)) for i in range(9)]
    w = token_weights([Group(0, samples)], "token")
    total = 0.0
    for idx in micro_batches([s.total_len for s in samples], 13):
        mb = pack([samples[i] for i in idx], 8)
        total += sum(w[s.sample_id] * sum(s.loss_mask) for s in mb.samples)
    assert total == pytest.approx(1.0)


# -- advantages ---------------------------------------------------------------------------------------


def test_grpo_with_bessel_corrected_std():
    g = Group(0, [sample(i, r, [1]) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])])
    # mean 0.5; sample std sqrt((4 * 0.25) / 3) = 0.57735
    adv = grpo_advantages([g], bessel=True, eps=0.0)
    assert adv[0] == pytest.approx(0.5 / math.sqrt(1 / 3)) and adv[1] == pytest.approx(-0.5 / math.sqrt(1 / 3))
    assert grpo_advantages([g], eps=0.0)[0] == pytest.approx(1.0)  # the population std stays the default


def test_branches_with_different_rewards_are_an_error_or_combined_as_asked():
    g = Group(3, [sample(0, 1.0, [1], traj=5), sample(1, 0.0, [1], traj=5), sample(2, 0.0, [1])])
    with pytest.raises(RLXError, match=r"group 3: trajectory 5 has branches with different rewards \[1.0, 0.0\]"):
        grpo_advantages([g])
    # mean: trajectory 5 gets 0.5, trajectory 2 gets 0: centred +-0.25, both of 5's branches alike
    adv = grpo_advantages([g], normalize_std=False, branch_rewards="mean")
    assert adv == {0: pytest.approx(0.25), 1: pytest.approx(0.25), 2: pytest.approx(-0.25)}
    assert grpo_advantages([g], normalize_std=False, branch_rewards="max")[1] == pytest.approx(0.5)


def test_reinforce_pp_discounts_over_model_tokens_and_whitens_over_the_batch_tokens():
    # A: reward 1, mask [1, 1, 0, 1], gamma 0.5 -> returns [0.25, 0.5, (tool) 0, 1]; B: reward 0 -> [0, 0]
    a, b = sample(0, 1.0, [1, 1, 0, 1]), sample(1, 0.0, [1, 1], gid=1)
    adv = reinforce_pp_advantages([Group(0, [a]), Group(1, [b])], gamma=0.5, eps=0.0)
    values = [0.25, 0.5, 1.0, 0.0, 0.0]  # the batch's loss-masked tokens
    mean = sum(values) / 5
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 5)
    assert adv[0] == pytest.approx([(0.25 - mean) / sd, (0.5 - mean) / sd, 0.0, (1.0 - mean) / sd])
    assert adv[1] == pytest.approx([-mean / sd, -mean / sd])


def test_reinforce_pp_baseline_whitens_per_token_not_per_sample():
    # group rewards 1 and 0 -> centred +0.5 (2 tokens) and -0.5 (3 tokens); token mean -0.1, std sqrt(0.24)
    g = Group(0, [sample(0, 1.0, [1, 1]), sample(1, 0.0, [1, 1, 1])])
    adv = reinforce_pp_baseline_advantages([g], eps=0.0)
    sd = math.sqrt(0.24)
    assert adv[0] == pytest.approx([0.6 / sd] * 2) and adv[1] == pytest.approx([-0.4 / sd] * 3)


def test_estimators_are_registered_under_the_names_peers_use():
    from rlx.plugins import build_plugins

    p = build_plugins(entry_points=False)
    assert {"grpo", "reinforce_pp", "reinforce_pp_baseline"} <= set(p.names("advantages"))
    assert {"ppo_clip", "gspo", "cispo"} <= set(p.names("losses"))
    assert p.build("advantages", {"name": "reinforce_pp", "args": {"gamma": 0.9}}).config.gamma == 0.9


# -- losses and corrections -------------------------------------------------------------------------


def test_cispo_clips_and_detaches_the_weight_and_keeps_every_token_gradient():
    logp = T([math.log(0.5), math.log(0.5), math.log(0.5)], requires_grad=True)
    old = T([math.log(0.25), math.log(0.5), math.log(1.0)])  # ratios 2, 1, 0.5
    adv = T([1.0, -1.0, 2.0])
    loss, clipped = cispo_loss(logp, old, adv, ClipConfig(eps_low=1.0, eps_high=0.28))
    weights = [1.28, 1.0, 0.5]  # 2 clipped to 1 + 0.28; no lower bound
    assert loss.tolist() == pytest.approx([-w * a * math.log(0.5) for w, a in zip(weights, [1.0, -1.0, 2.0])])
    assert clipped.tolist() == [True, False, False]
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.28, 1.0, -1.0])  # -w * A: the weight is a constant


def test_importance_ratio_per_token_sequence_and_geometric():
    old = T([0.0, 0.0, 0.0, 0.0])
    rollout = T([-math.log(2), -math.log(4), 0.0, -math.log(3)])  # token ratios 2, 4, 1, 3
    has, mask = torch.ones(4), T([1.0, 1.0, 0.0, 1.0])
    seq = torch.tensor([0, 0, 0, 1])
    assert importance_ratio(old, rollout, has).tolist() == pytest.approx([2, 4, 1, 3])
    # sequence 0: product over its loss-masked tokens 2 * 4 = 8; geometric mean sqrt(8)
    assert importance_ratio(old, rollout, has, "sequence", seq, mask).tolist() == pytest.approx([8, 8, 8, 3])
    assert importance_ratio(old, rollout, has, "geometric", seq, mask).tolist() == pytest.approx(
        [math.sqrt(8)] * 3 + [3])
    # a token without engine log-probs counts as ratio 1 and stays out of its sequence's product
    assert importance_ratio(old, rollout, T([1.0, 0.0, 1.0, 1.0]), "sequence", seq, mask).tolist() == \
        pytest.approx([2, 2, 2, 3])


def test_tis_lower_bound_and_two_sided_masking():
    r = T([0.2, 0.7, 1.5, 3.0])
    assert tis_weights(r, cap=2.0).tolist() == pytest.approx([0.2, 0.7, 1.5, 2.0])
    assert tis_weights(r, cap=2.0, low=0.5).tolist() == pytest.approx([0.5, 0.7, 1.5, 2.0])
    assert tis_weights(r, cap=2.0, mode="mask", low=0.5).tolist() == pytest.approx([0.0, 0.7, 1.5, 0.0])  # IcePop


def test_unbiased_kl_is_k3_times_the_ratio_to_the_sampling_policy():
    lp, ref, old = T([math.log(0.5)]), T([math.log(0.25)]), T([math.log(0.4)])
    k3 = 0.25 / 0.5 - math.log(0.25 / 0.5) - 1  # ref/p - log(ref/p) - 1
    assert kl_penalty(lp, ref, "unbiased", old).item() == pytest.approx(0.5 / 0.4 * k3)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(k3)


def test_samples_without_engine_log_probs_get_no_correction_and_are_not_probed():
    from rlx.plugins import build_plugins

    policy = build_plugins(entry_points=False).build("losses", "ppo_clip")
    logp = T([math.log(0.5)] * 4, requires_grad=True)
    inp = LossInputs(logprobs=logp, old_logprobs=logp.detach(), rollout_logprobs=T([math.log(0.25), 0, 0, 0]),
                     advantages=T([1.0, 1.0, 1.0, 1.0]), weights=T([0.25] * 4), mask=torch.ones(4),
                     seq_index=torch.tensor([0, 1, 1, 1]), has_rollout=T([1.0, 0.0, 0.0, 0.0]))
    _, m = objective(inp, policy, ObjectiveConfig(tis_cap=1.5), diff_threshold=0.5)
    # token 0: ratio 2 capped at 1.5; the others have no engine log-probs: weight 1, not exp(log 0.5 - 0)
    assert m["tis_weight"] == pytest.approx(0.25 * 1.5 + 0.75)
    assert m["rollout_tokens"] == 1 and m["train_rollout_logprob_diff"] == pytest.approx(math.log(2))
    assert m["train_rollout_logprob_diff_over"] == 1
    assert m["train_rollout_logprob_diff_max"] == pytest.approx(math.log(2))


def test_gspo_averages_per_sequence_unless_told_otherwise_and_the_run_says_so():
    from rlx.config import parse_config
    from rlx.orchestrate.metrics import objective_notes
    from rlx.plugins import build_plugins
    from rlx.train.step import loss_norm

    p = build_plugins(entry_points=False)
    gspo, ppo = p.build("losses", "gspo"), p.build("losses", "ppo_clip")
    assert loss_norm(ObjectiveConfig(), gspo) == "sequence" and loss_norm(ObjectiveConfig(), ppo) == "token"
    assert loss_norm(ObjectiveConfig(loss_norm="token"), gspo) == "token"
    cfg = parse_config("model: {path: /m}\ntrain: {objective: {loss: gspo, loss_norm: token}}")
    assert any("not the paper's" in n for n in objective_notes(cfg, p))
    cfg = parse_config("model: {path: /m}\ntrain: {objective: {loss: gspo}}")
    assert objective_notes(cfg, p) == []
    cfg = parse_config("model: {path: /m}\nrollout: {sampling: {top_p: 0.9}}\ntrain: {objective: {tis_cap: 2}}")
    assert any("not exact" in n for n in objective_notes(cfg, p))


# -- the data the trainer sees ---------------------------------------------------------------------


def test_engine_results_record_temperature_and_missing_log_probs_explicitly():
    from rlx.rollout.context import append_env_tokens, append_model_tokens
    from rlx.rollout.engines.client import GenerateResult

    def res(ids, lps, t):
        r = GenerateResult("", ids, lps, "stop", None, "1", [], 3, None, {})
        r.temperature = t
        return r

    s = Sample([1, 2, 3])
    append_model_tokens(s, res([4, 5], [-0.1, -0.2], 0.6))
    append_env_tokens(s, [6])
    append_model_tokens(s, res([7], [-0.3], 0.0))  # greedy: the engine reports plain log-probs
    assert s.token_temperatures == [0.6, 0.6, 1.0, 1.0] and s.rollout_logprobs == [-0.1, -0.2, 0.0, -0.3]
    append_model_tokens(s, res([8], [], 1.0))  # an engine that reports none
    assert s.rollout_logprobs is None and len(s.token_temperatures) == len(s.response_ids) == 5
    append_env_tokens(s, [9])
    assert s.rollout_logprobs is None and s.loss_mask == [1, 1, 0, 1, 1, 0]


def test_packed_rows_carry_each_tokens_temperature():
    from rlx.train.packing import pack

    a = Sample([1, 2], [3, 4], [1, 1], [-1, -1], token_temperatures=[0.6, 0.6])
    b = Sample([5], [6, 7, 8], [1, 0, 1], [-1, 0, -1])  # from before temperatures were recorded: 1.0
    assert pack([a, b]).temperatures.tolist() == pytest.approx([0.6, 0.6, 1.0, 1.0, 1.0])


def test_run_probes_count_samples_without_log_probs_and_tito_mismatches():
    from rlx.train.step import batch_probes

    a = sample(0, 1.0, [1, 1, 0, 1])
    a.metadata["sampled_tokens"] = 3
    b = sample(1, 0.0, [1, 1])
    b.metadata["sampled_tokens"] = 3  # one sampled token did not make it into training
    c = sample(2, 0.0, [1])
    c.rollout_logprobs = None
    assert batch_probes([a, b, c]) == {"rollout_logprobs_missing": 1.0, "tito/trained_tokens": 5.0,
                                       "tito/sampled_tokens": 6.0, "tito/mismatched_samples": 1.0}


def test_a_jump_in_the_log_prob_difference_is_reported():
    from rlx.orchestrate.metrics import DiffWatch

    w = DiffWatch()
    assert [w.see(i, d) for i, d in enumerate([1e-7, 2e-7, 1e-7])] == [None, None, None]
    assert w.see(3, 0.09) == "step 3: train_rollout_logprob_diff jumped to 0.09 (median of the last 3 steps 1e-07)"
    assert w.see(4, None) is None


def test_each_update_normalises_over_its_own_mini_batch():
    from rlx.train.step import mini_batch_scales, prepare
    from rlx.types import RolloutBatch

    class Flat:
        name = "flat"

        def advantages(self, groups):
            return {s.sample_id: 1.0 for g in groups for s in g.trainable}

    g = Group(0, [sample(0, 1.0, [1, 1]), sample(1, 0.0, [1]), sample(2, 0.0, [1, 1, 1])])
    tb = prepare(RolloutBatch(1, [g]), Flat(), "token")  # 6 loss tokens: 1/6 each
    cuts = [tb.samples[0::2], tb.samples[1::2]]  # samples 0 and 2 (5 tokens), sample 1 (1 token)
    assert mini_batch_scales(tb, cuts) == pytest.approx([6 / 5, 6.0])
    assert mini_batch_scales(tb, [tb.samples]) == [1.0]


def test_tokens_masked_for_staleness_are_not_a_tito_mismatch():
    from rlx.train.step import batch_probes

    s = sample(0, 1.0, [1, 0, 1])  # one of three sampled tokens masked as stale
    s.metadata.update(sampled_tokens=3, stale_masked_tokens=1)
    assert batch_probes([s])["tito/mismatched_samples"] == 0.0


def test_samples_saved_with_zeros_for_missing_log_probs_load_as_missing():
    old = Sample([1], [2, 3], [1, 1], [0.0, 0.0], metadata={"no_rollout_logprobs": True}).to_dict()
    again = Sample.from_dict(old)
    assert again.rollout_logprobs is None and "no_rollout_logprobs" not in again.metadata
    assert Sample.from_dict(sample(1, 1.0, [1]).to_dict()).rollout_logprobs == [-1.0]


def test_objective_settings_that_cannot_mean_anything_are_config_errors():
    from rlx.config import parse_config
    from rlx.errors import ConfigError

    assert parse_config("model: {path: /m}\nweight_sync: {verify: off}").weight_sync.verify == "off"
    assert parse_config("model: {path: /m}\nweight_sync: {verify: true}").weight_sync.verify == "sample"
    with pytest.raises(ConfigError, match="tis_low is a bound of importance sampling, which is off"):
        parse_config("model: {path: /m}\ntrain: {objective: {tis_low: 0.5}}")
    with pytest.raises(ConfigError, match=r"tis_low \(3.0\) must not exceed tis_cap \(2.0\)"):
        parse_config("model: {path: /m}\ntrain: {objective: {tis_low: 3.0, tis_cap: 2.0}}")
