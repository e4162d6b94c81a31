"""Advantage estimators and loss normalisation: per-sample numbers computed once for the global batch.

The built-in estimators (``train.objective.advantage``), each ``advantages(groups) -> {sample_id: advantage}``:

* ``grpo``: GRPO (Shao et al. 2024, DeepSeekMath): group-relative, per sample.
* ``reinforce_pp``: REINFORCE++ (Hu 2025): discounted per-token returns, whitened over the batch's tokens.
* ``reinforce_pp_baseline``: REINFORCE++ with the group mean as baseline, whitened over the batch's tokens.
* ``gae``: PPO's generalised advantage estimation (Schulman et al. 2016) from a critic's per-token values
  (``train.critic``); it also gives the critic its targets (returns).

Choices:

* GRPO's advantages are per sample (broadcast over its tokens by the RL step); REINFORCE++'s are per
  response token, whitened over every loss-masked token of the batch as the paper does.
* An agent's branches (subagents, context compaction) are several samples with one ``trajectory_id``:
  they share its reward and count once in group statistics and in sequence/group normalisation. Branches
  that disagree are an error unless the estimator's ``branch_rewards`` says how to combine them.
* Normalisation is a per-token weight computed once for the whole global batch (`token_weights`), so a
  micro-batch's loss is ``sum(weight * per_token_loss)`` and micro-batches and data-parallel ranks add
  up to exactly the global loss, whatever the batch size: ``token`` (every response token counts
  equally), ``sequence`` (every sample equally) or ``group`` (every prompt equally, its samples sharing
  its weight; a prompt that yielded many samples does not outweigh one that yielded few).

GAE (as verl and OpenRLHF do it, and where they are silent, what the papers say):

* Per-token values, rewards, advantages and returns are lists over a sample's response tokens. Only model
  tokens (loss mask 1) take part: tool and user tokens between turns are skipped, and the recursion carries
  across them as if they were not there (the environment's tokens are part of the next state, not an
  action). They get advantage 0 and return 0, and are never trained.
* The value at a token is the critic's estimate of the state before that token, as the log-prob of a token
  comes from the position before it. The state after the last model token is terminal (value 0).
* The reward is the sample's (its trajectory's) at its last model token. An agent's branches (subagents,
  compaction) are samples of their own, each ending with the trajectory's reward, as in every other
  estimator of rlx. With a KL penalty in the reward, ``-kl_coef * kl`` is added at every model token, so the
  critic learns KL-shaped returns and the policy loss adds no KL term of its own.
* The policy's advantages and the critic's targets may use different lambdas (VAPO, Yuan et al. 2025:
  ``lam_critic`` 1.0 makes the returns unbiased Monte Carlo ones, while the policy keeps a lower-variance
  ``lam``). Returns are ``A(lam_critic) + V``.
* Whitening (optional) subtracts the mean and divides by the std of the advantages over every model token
  of the batch (population std); returns are never whitened.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl
from rlx.errors import RLXError
from rlx.hookspecs import RegisterAdvantages
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


# -- GAE (PPO with a critic) -------------------------------------------------------------------


def token_rewards(mask: Sequence[int], reward: float, kl: Sequence[float] | None = None,
                  kl_coef: float = 0.0) -> list[float]:
    """Per response token: `reward` at the last model token, ``-kl_coef * kl`` at every model token."""
    out = [0.0] * len(mask)
    model = [i for i, m in enumerate(mask) if m]
    if kl is not None and kl_coef:
        for i in model:
            out[i] -= kl_coef * float(kl[i])
    if model:
        out[model[-1]] += reward
    return out


def gae(rewards: Sequence[float], values: Sequence[float], mask: Sequence[int], gamma: float,
        lam: float) -> list[float]:
    """Per response token advantages over model tokens: ``A_k = d_k + gamma*lam*A_{k+1}`` with
    ``d_k = r_k + gamma*V_{k+1} - V_k``, where k runs over model tokens only and the state after the last
    one is terminal. 0 at other tokens."""
    out = [0.0] * len(mask)
    next_value = 0.0
    running = 0.0
    for i in range(len(mask) - 1, -1, -1):
        if not mask[i]:
            continue
        delta = rewards[i] + gamma * next_value - values[i]
        running = delta + gamma * lam * running
        out[i] = running
        next_value = values[i]
    return out


def advantages_and_returns(masks: Mapping[int, Sequence[int]], rewards: Mapping[int, float],
                           values: Mapping[int, Sequence[float]], gamma: float = 1.0, lam: float = 0.95,
                           lam_critic: float | None = None, kl: Mapping[int, Sequence[float]] | None = None,
                           kl_coef: float = 0.0, whiten: bool = False,
                           eps: float = 1e-8) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Per sample id: the policy's advantages (GAE with `lam`, optionally whitened over the batch's model
    tokens) and the critic's returns (GAE with `lam_critic`, default `lam`, plus the values)."""
    lam_c = lam if lam_critic is None else lam_critic
    adv: dict[int, list[float]] = {}
    ret: dict[int, list[float]] = {}
    for sid, mask in masks.items():
        r = token_rewards(mask, rewards[sid], kl[sid] if kl is not None else None, kl_coef)
        v = [float(x) for x in values[sid]]
        if len(v) != len(mask):
            raise ValueError(f"sample {sid}: {len(v)} values for {len(mask)} response tokens")
        adv[sid] = gae(r, v, mask, gamma, lam)
        critic_adv = adv[sid] if lam_c == lam else gae(r, v, mask, gamma, lam_c)
        ret[sid] = [a + x if m else 0.0 for a, x, m in zip(critic_adv, v, mask, strict=True)]
    if whiten:
        flat = [a for sid, a_s in adv.items() for a, m in zip(a_s, masks[sid], strict=True) if m]
        if flat:
            mean = sum(flat) / len(flat)
            sd = std(flat)
            adv = {sid: [(a - mean) / (sd + eps) if m else 0.0 for a, m in zip(a_s, masks[sid], strict=True)]
                   for sid, a_s in adv.items()}
    return adv, ret


def explained_variance(values: Sequence[float], returns: Sequence[float]) -> float:
    """``1 - Var(R - V) / Var(R)`` over the given tokens (population variances); 0 when Var(R) is 0."""
    if len(returns) < 2:
        return 0.0
    var_r = std(list(returns)) ** 2
    if var_r == 0:
        return 0.0
    return 1.0 - std([r - v for r, v in zip(returns, values, strict=True)]) ** 2 / var_r


# -- the built-in estimators ---------------------------------------------------------------------


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    branch_rewards: Literal["error", "mean", "max", "min"] = "error"  # branches of one trajectory that disagree
    eps: float = Field(1e-6, gt=0)  # added to the std before dividing


class GRPO:
    """Group-relative advantages: each reward minus its group's mean, over the group's std."""

    name = "grpo"

    class Config(_Args):
        normalize_std: bool = True  # off: Dr. GRPO, no division by the group std
        bessel: bool = False  # the sample std (n - 1) instead of the population std (n, the default)

    def __init__(self, config: Config):
        self.config = config

    def advantages(self, groups):
        c = self.config
        return grpo_advantages(groups, c.normalize_std, c.eps, c.bessel, c.branch_rewards)


class ReinforcePP:
    """REINFORCE++: the reward at the last model token, discounted back by gamma, whitened over the batch."""

    name = "reinforce_pp"

    class Config(_Args):
        gamma: float = Field(1.0, ge=0, le=1)  # discount per model token

    def __init__(self, config: Config):
        self.config = config

    def advantages(self, groups):
        c = self.config
        return reinforce_pp_advantages(groups, c.gamma, c.eps, c.branch_rewards)


class ReinforcePPBaseline:
    """REINFORCE++ with a baseline: the reward minus its group's mean, whitened over the batch's tokens."""

    name = "reinforce_pp_baseline"
    Config = _Args

    def __init__(self, config: _Args):
        self.config = config

    def advantages(self, groups):
        return reinforce_pp_baseline_advantages(groups, self.config.eps, self.config.branch_rewards)


class GAE:
    """Generalised advantage estimation from a critic's values, per model token (`advantages_and_returns`). It needs
    values, so the trainer calls `advantages_and_returns` (``needs_critic``), never `advantages`."""

    name = "gae"
    needs_critic = True

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        gamma: float = Field(1.0, ge=0, le=1)  # discount per model token
        lam: float = Field(0.95, ge=0, le=1)  # GAE's lambda for the policy's advantages
        lam_critic: float | None = Field(None, ge=0, le=1)  # for the critic's returns (None: lam; VAPO: 1.0)
        whiten: bool = True  # advantages minus their mean over the batch's model tokens, over their std
        branch_rewards: Literal["error", "mean", "max", "min"] = "error"  # branches of one trajectory that disagree
        eps: float = Field(1e-8, gt=0)  # added to the std before dividing (whiten)

    def __init__(self, config: Config):
        self.config = config

    def advantages(self, groups):
        raise RLXError("the gae estimator needs a critic's values: the trainer calls advantages_and_returns")

    def advantages_and_returns(self, groups, values, kl=None, kl_coef=0.0):
        """Per sample id: advantages and returns (lists over response tokens). `values`: the critic's per
        response token; `kl`: per-token KL to the reference, put into the reward times `kl_coef`."""
        c = self.config
        masks, rewards = {}, {}
        for g in groups:
            traj = trajectory_rewards(g, c.branch_rewards)
            for tid, ss in trajectories([s for s in g.trainable if s.reward is not None]).items():
                for s in ss:
                    masks[s.sample_id] = s.loss_mask
                    rewards[s.sample_id] = traj[tid]
        return advantages_and_returns(masks, rewards, values, c.gamma, c.lam, c.lam_critic, kl, kl_coef,
                                            c.whiten, c.eps)


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


@hookimpl
def register_advantages(register: RegisterAdvantages) -> None:
    for cls in (GRPO, ReinforcePP, ReinforcePPBaseline, GAE):
        register(cls)
