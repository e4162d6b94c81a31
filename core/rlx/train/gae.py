"""Generalised advantage estimation and the value loss, for PPO with a critic (Schulman et al. 2016, 2017).

Choices (as verl and OpenRLHF do, and where they are silent, what the papers say):

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

from collections.abc import Mapping, Sequence

import torch

from rlx.train.advantages import std


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


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token value loss ``0.5 * (V - R)^2``; with `clip`, PPO's clipped form
    ``0.5 * max((V - R)^2, (V_old + clamp(V - V_old, -clip, clip) - R)^2)``. Also a per-token bool of
    where the clipped term was the larger (the clip fraction)."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(values, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(values: Sequence[float], returns: Sequence[float]) -> float:
    """``1 - Var(R - V) / Var(R)`` over the given tokens (population variances); 0 when Var(R) is 0."""
    if len(returns) < 2:
        return 0.0
    var_r = std(list(returns)) ** 2
    if var_r == 0:
        return 0.0
    return 1.0 - std([r - v for r, v in zip(returns, values, strict=True)]) ** 2 / var_r
