"""Advantage estimators and loss normalisation: per-sample numbers computed once for the global batch.

Choices:

* GRPO's advantages are per sample (broadcast over its tokens by the RL step); REINFORCE++'s are per
  response token, whitened over every loss-masked token of the batch as the paper does.
* An agent's branches (subagents, context compaction) are several samples with one ``trajectory_id``:
  they share its reward and count once in group statistics and in sequence/group normalisation.
* Normalisation is a per-token weight computed once for the whole global batch (`token_weights`), so a
  micro-batch's loss is ``sum(weight * per_token_loss)`` and micro-batches and data-parallel ranks add
  up to exactly the global loss, whatever the batch size: ``token`` (every response token counts
  equally), ``sequence`` (every sample equally) or ``group`` (every prompt equally, its samples sharing
  its weight; a prompt that yielded many samples does not outweigh one that yielded few).
"""

from __future__ import annotations

import math
from typing import Literal

from rlx.errors import RLXError
from rlx.types import Group, Sample

Norm = Literal["token", "sequence", "group"]


def trajectories(samples: list[Sample]) -> dict[int, list[Sample]]:
    """Samples by trajectory: an agent's branches (subagents, context compaction) are several samples
    with one ``trajectory_id``, sharing its reward; any other sample is a trajectory of its own."""
    out: dict[int, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.trajectory_id if s.trajectory_id is not None else s.sample_id, []).append(s)
    return out


def trajectory_rewards(group: Group, branch_rewards: str = "error") -> dict[int, float]:
    """One reward per trajectory of the group's scored trainable samples.

    An agent's branches normally share their trajectory's reward (the manager scores a trajectory once).
    Branches that carry different rewards are an error, unless `branch_rewards` says how to combine them:
    ``mean``, ``max`` or ``min``.
    """
    out: dict[int, float] = {}
    for tid, ss in trajectories([s for s in group.trainable if s.reward is not None]).items():
        values = [s.reward for s in ss if s.reward is not None]  # all of them: for the type checker
        if max(values) - min(values) > 1e-12:
            if branch_rewards == "error":
                raise RLXError(
                    f"group {group.group_id}: trajectory {tid} has branches with different rewards {values} "
                    f"(samples {[s.sample_id for s in ss]}); a trajectory has one reward. Set the estimator's "
                    f"branch_rewards to mean, max or min to combine them")
            values = [{"mean": sum(values) / len(values), "max": max(values), "min": min(values)}[branch_rewards]]
        out[tid] = values[0]
    return out


def std(values: list[float], bessel: bool = False) -> float:
    """Population std, or the sample std (Bessel's n - 1) when `bessel`; 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1 if bessel else n))


def grpo_advantages(groups: list[Group], normalize_std: bool = True, eps: float = 1e-6, bessel: bool = False,
                    branch_rewards: str = "error") -> dict[int, float]:
    """GRPO (Shao et al. 2024): ``(r - mean_group) / (std_group + eps)``; without the std when
    `normalize_std` is off (Dr. GRPO, Liu et al. 2025).

    Statistics are over the group's trajectories, each counted once however many samples it branched
    into; every sample of a trajectory gets its advantage. The std is the population std (a group of
    identical rewards gets 0), or the sample std with `bessel`. Returns sample_id -> advantage.
    """
    out: dict[int, float] = {}
    for g in groups:
        rewards = trajectory_rewards(g, branch_rewards)
        if not rewards:
            continue
        mean = sum(rewards.values()) / len(rewards)
        sd = std(list(rewards.values()), bessel)
        for tid, ss in trajectories([s for s in g.trainable if s.reward is not None]).items():
            adv = (rewards[tid] - mean) / (sd + eps) if normalize_std else rewards[tid] - mean
            for s in ss:
                out[s.sample_id] = adv
    return out


def discounted_returns(sample: Sample, reward: float, gamma: float) -> list[float]:
    """Per response token: the reward at the sample's last model token, discounted back over model tokens
    only (tool and user tokens between turns are skipped, and get 0)."""
    out = [0.0] * len(sample.response_ids)
    g = reward
    for i in range(len(sample.response_ids) - 1, -1, -1):
        if sample.loss_mask[i]:
            out[i] = g
            g *= gamma
    return out


def whiten_tokens(per_token: dict[int, list[float]], samples: dict[int, Sample], eps: float) -> dict[int, list[float]]:
    """Subtract the mean and divide by the std of the values at every loss-masked token of the batch."""
    values = [v for sid, vs in per_token.items() for v, m in zip(vs, samples[sid].loss_mask, strict=True) if m]
    if not values:
        return per_token
    mean = sum(values) / len(values)
    sd = std(values)
    return {sid: [(v - mean) / (sd + eps) if m else 0.0 for v, m in zip(vs, samples[sid].loss_mask, strict=True)]
            for sid, vs in per_token.items()}


def reinforce_pp_advantages(groups: list[Group], gamma: float = 1.0, eps: float = 1e-6,
                            branch_rewards: str = "error") -> dict[int, list[float]]:
    """REINFORCE++ (Hu 2025): per-token discounted returns of the reward, whitened over every loss-masked
    token of the batch; no group baseline."""
    samples: dict[int, Sample] = {}
    returns: dict[int, list[float]] = {}
    for g in groups:
        rewards = trajectory_rewards(g, branch_rewards)
        for tid, ss in trajectories([s for s in g.trainable if s.reward is not None]).items():
            for s in ss:
                samples[s.sample_id] = s
                returns[s.sample_id] = discounted_returns(s, rewards[tid], gamma)
    return whiten_tokens(returns, samples, eps)


def reinforce_pp_baseline_advantages(groups: list[Group], eps: float = 1e-6,
                                     branch_rewards: str = "error") -> dict[int, list[float]]:
    """REINFORCE++ with a baseline (Hu 2025, the "-baseline" variant): the reward minus its group's mean,
    on every token of the sample, whitened over every loss-masked token of the batch."""
    samples = {s.sample_id: s for g in groups for s in g.trainable if s.reward is not None}
    centred = grpo_advantages(groups, normalize_std=False, branch_rewards=branch_rewards)
    per_token = {sid: [a] * len(samples[sid].response_ids) for sid, a in centred.items()}
    return whiten_tokens(per_token, samples, eps)


# -- normalisation -------------------------------------------------------------------------------


def token_weights(groups: list[Group], norm: Norm) -> dict[int, float]:
    """The weight of each loss-masked token of each trainable sample (sample_id -> weight per token).

    ``token``: one over the batch's loss-masked tokens. ``sequence``: one over the number of trajectories
    with any loss-masked token, shared by that trajectory's tokens. ``group``: one over the groups with any
    such trajectory, shared equally by their trajectories. A trajectory's branches share its weight by
    their tokens, as if they were one sequence; samples and trajectories without loss-masked tokens add
    nothing to any denominator.
    """
    samples = [s for g in groups for s in g.trainable]
    if norm == "token":
        total = sum(sum(s.loss_mask) for s in samples)
        return {s.sample_id: 1.0 / total if total else 0.0 for s in samples}
    if norm not in ("sequence", "group"):
        raise ValueError(f"unknown loss normalisation {norm!r}")
    w = dict.fromkeys((s.sample_id for s in samples), 0.0)
    live = []
    for g in groups:
        trajs = [ss for ss in trajectories(g.trainable).values() if sum(sum(s.loss_mask) for s in ss)]
        if trajs:
            live.append(trajs)
    n_trajs = sum(len(t) for t in live)
    for trajs in live:
        for ss in trajs:
            share = 1.0 / n_trajs if norm == "sequence" else 1.0 / (len(live) * len(trajs))
            tokens = sum(sum(s.loss_mask) for s in ss)
            for s in ss:
                w[s.sample_id] = share / tokens
    return w
