"""GAE, returns and the value loss against values computed by hand from the papers (Schulman et al. 2016
eq. 16; PPO's clipped value loss; VAPO's separate critic lambda), with multi-turn masks and empty masks."""

import pytest
import torch

from rlx.train.advantages import advantages_and_returns, explained_variance, gae, token_rewards
from rlx.train.losses import value_loss


def test_with_gamma_and_lambda_one_the_advantage_is_the_reward_minus_the_value():
    # d2 = 1 - 0.4 = 0.6; d1 = 0.4 - 0.2 = 0.2; d0 = 0.2 - 0.5 = -0.3; A = running sums from the end
    assert gae([0, 0, 1], [0.5, 0.2, 0.4], [1, 1, 1], 1.0, 1.0) == pytest.approx([0.5, 0.8, 0.6])


def test_tool_tokens_are_skipped_and_the_recursion_carries_across_them():
    mask = [1, 1, 0, 0, 1]
    values = [0.1, 0.2, 9.0, 9.0, 0.3]  # the values at tool tokens must not matter
    rewards = token_rewards(mask, 2.0)
    assert rewards == [0, 0, 0, 0, 2.0]
    # gamma 0.9, lam 0.5: d4 = 2 - 0.3 = 1.7; d1 = 0.9*0.3 - 0.2 = 0.07; d0 = 0.9*0.2 - 0.1 = 0.08
    # A4 = 1.7; A1 = 0.07 + 0.45*1.7 = 0.835; A0 = 0.08 + 0.45*0.835 = 0.45575
    assert gae(rewards, values, mask, 0.9, 0.5) == pytest.approx([0.45575, 0.835, 0, 0, 1.7])


def test_the_critic_lambda_of_one_gives_monte_carlo_returns_while_the_policy_keeps_its_own():
    adv, ret = advantages_and_returns({7: [1, 1, 0, 0, 1]}, {7: 2.0}, {7: [0.1, 0.2, 9.0, 9.0, 0.3]},
                                      gamma=0.9, lam=0.5, lam_critic=1.0)
    assert adv[7] == pytest.approx([0.45575, 0.835, 0, 0, 1.7])
    assert ret[7] == pytest.approx([2 * 0.81, 2 * 0.9, 0, 0, 2.0])  # discounted reward, 0 at tool tokens
    _, same = advantages_and_returns({7: [1, 1, 0, 0, 1]}, {7: 2.0}, {7: [0.1, 0.2, 9.0, 9.0, 0.3]},
                                     gamma=0.9, lam=0.5)
    assert same[7] == pytest.approx([0.45575 + 0.1, 0.835 + 0.2, 0, 0, 1.7 + 0.3])  # A(lam) + V


def test_a_kl_penalty_in_the_reward_lands_on_every_model_token():
    assert token_rewards([1, 1, 0, 0, 1], 2.0, [0.1, -0.2, 5.0, 5.0, 0.3], 0.5) == \
        pytest.approx([-0.05, 0.1, 0, 0, 1.85])
    # gamma = lam = 1, zero values: the advantage is the sum of rewards from the token on
    adv, ret = advantages_and_returns({1: [1, 1, 0, 0, 1]}, {1: 2.0}, {1: [0.0] * 5},
                                      kl={1: [0.1, -0.2, 5.0, 5.0, 0.3]}, kl_coef=0.5, lam=1.0)
    assert adv[1] == pytest.approx([1.9, 1.95, 0, 0, 1.85]) and ret[1] == pytest.approx(adv[1])


def test_ragged_samples_whitened_over_the_batch_model_tokens_and_an_empty_mask():
    masks = {1: [1, 1, 1], 2: [0, 1], 3: [0, 0, 0, 0]}
    rewards = {1: 1.0, 2: 0.0, 3: 5.0}
    values = {1: [0.5, 0.2, 0.4], 2: [3.0, 0.5], 3: [1.0] * 4}
    raw, ret = advantages_and_returns(masks, rewards, values, lam=1.0)
    assert raw == {1: pytest.approx([0.5, 0.8, 0.6]), 2: pytest.approx([0, -0.5]), 3: [0.0] * 4}
    assert ret[3] == [0.0] * 4  # no model token: nothing to learn, nothing to train
    adv, _ = advantages_and_returns(masks, rewards, values, lam=1.0, whiten=True)
    flat = [0.5, 0.8, 0.6, -0.5]
    mean = sum(flat) / 4
    sd = (sum((x - mean) ** 2 for x in flat) / 4) ** 0.5
    assert adv[1] == pytest.approx([(x - mean) / sd for x in flat[:3]], abs=1e-6)
    assert adv[2] == pytest.approx([0.0, (-0.5 - mean) / sd], abs=1e-6) and adv[3] == [0.0] * 4
    empty, _ = advantages_and_returns({3: [0, 0]}, {3: 1.0}, {3: [0.0, 0.0]}, whiten=True)
    assert empty == {3: [0.0, 0.0]}


def test_values_must_cover_the_response():
    with pytest.raises(ValueError, match="sample 4: 2 values for 3 response tokens"):
        advantages_and_returns({4: [1, 1, 1]}, {4: 1.0}, {4: [0.0, 0.0]})


def test_value_loss_clipped_and_unclipped_by_hand():
    v = torch.tensor([1.0, 0.0, 2.0])
    old = torch.tensor([0.8, 0.5, 2.0])
    ret = torch.tensor([0.0, -1.0, 2.5])
    # t0: (1-0)^2 = 1 vs (0.9-0)^2 = 0.81; t1: (0+1)^2 = 1 vs (0.4+1)^2 = 1.96 (clip bites); t2: 0.25 both
    loss, clipped = value_loss(v, old, ret, 0.1)
    assert loss.tolist() == pytest.approx([0.5, 0.98, 0.125])
    assert clipped.tolist() == [False, True, False]
    loss, clipped = value_loss(v, old, ret, None)
    assert loss.tolist() == pytest.approx([0.5, 0.5, 0.125]) and not clipped.any()


def test_explained_variance_by_hand():
    # Var(R) = 14/9, Var(R - V) = 2/9: 1 - 1/7
    assert explained_variance([1, 2, 3], [1, 2, 4]) == pytest.approx(6 / 7)
    assert explained_variance([1, 2], [3, 3]) == 0.0  # no variance to explain
    assert explained_variance([0.0], [1.0]) == 0.0


def _s(sid, mask, reward, traj=None):
    from rlx.types import Sample, SampleStatus

    return Sample([1, 2], list(range(3, 3 + len(mask))), list(mask), None, reward=reward, status=SampleStatus.COMPLETED,
                  sample_id=sid, group_id=0, trajectory_id=traj)


def test_the_gae_estimator_gives_each_branch_of_a_trajectory_its_reward_at_its_own_end():
    from rlx.train.advantages import GAE
    from rlx.types import Group

    est = GAE(GAE.Config(lam=1.0, whiten=False))
    # trajectory 10 fanned out into two branches (a subagent and the main one); sample 12 stands alone
    group = Group(0, [_s(10, [1, 0, 1], 1.0, traj=10), _s(11, [1, 1], 1.0, traj=10), _s(12, [1, 1], 0.0)])
    values = {10: [0.25, 7.0, 0.5], 11: [0.0, 0.75], 12: [0.5, 0.5]}
    adv, ret = est.advantages_and_returns([group], values)
    assert adv == {10: pytest.approx([0.75, 0, 0.5]), 11: pytest.approx([1.0, 0.25]), 12: pytest.approx([-0.5, -0.5])}
    assert ret == {10: pytest.approx([1.0, 0, 1.0]), 11: pytest.approx([1.0, 1.0]), 12: pytest.approx([0.0, 0.0])}
    with pytest.raises(Exception, match="needs a critic's values"):
        est.advantages([group])


def test_branches_that_disagree_on_the_reward_are_an_error_unless_told_how_to_combine():
    from rlx.train.advantages import GAE
    from rlx.errors import RLXError
    from rlx.types import Group

    group = Group(0, [_s(1, [1], 1.0, traj=1), _s(2, [1], 0.0, traj=1)])
    with pytest.raises(RLXError, match="trajectory 1 has branches with different rewards"):
        GAE(GAE.Config()).advantages_and_returns([group], {1: [0.0], 2: [0.0]})
    adv, _ = GAE(GAE.Config(whiten=False, branch_rewards="max")).advantages_and_returns([group], {1: [0.0], 2: [0.0]})
    assert adv == {1: [1.0], 2: [1.0]}
