"""Policy losses and the per-token terms beside them, as plain functions over flat per-token tensors.

Choices:

* Every tensor is flat over the tokens of a micro-batch (packed, no padding): ``[T]``. ``seq_index``
  says which sequence a token belongs to.
* Normalisation arrives as a per-token weight (`rlx.train.advantages.token_weights`), so a micro-batch's
  loss is ``sum(weight * per_token_loss)``.
* Log-probs: ``logprobs`` are the current policy's (with grad), ``old_logprobs`` the trainer's before
  this update, ``rollout_logprobs`` the engine's. Truncated importance sampling corrects for the gap
  between engine and trainer: weight ``min(exp(old - rollout), cap)``, no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KLType = Literal["k1", "k2", "k3", "low_var"]


# -- per-token terms -----------------------------------------------------------------------------


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1, k2, k3)."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    k3 = torch.exp(-log_ratio) + log_ratio - 1.0
    if kind == "k3":
        return k3
    if kind == "low_var":
        return k3.clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL type {kind!r}")


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float,
                mode: str = "truncate") -> torch.Tensor:
    """Importance weights between the trainer's and the engine's log-probs (no gradient).

    ``truncate``: the ratio, capped at `cap` (TIS). ``mask``: the ratio where it is at most `cap`, 0
    where it is above (masked importance sampling: tokens the engine sampled far off the trainer's
    policy, such as stale ones in async training, add nothing).
    """
    ratio = torch.exp(old_logprobs - rollout_logprobs).detach()
    if mode == "truncate":
        return ratio.clamp(max=cap)
    if mode == "mask":
        return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    raise ValueError(f"tis mode must be truncate or mask, not {mode!r}")


@dataclass
class ClipConfig:
    eps_low: float = 0.2  # ratio floor 1 - eps_low
    eps_high: float = 0.2  # ratio ceiling 1 + eps_high (clip-higher: make it larger than eps_low)
    dual_clip: float | None = None  # c > 1: cap the loss of negative advantages at -c * A


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  clip: ClipConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss (to minimise) and whether each token was clipped."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if clip.dual_clip is not None:
        if clip.dual_clip <= 1.0:
            raise ValueError("dual_clip must be > 1")
        capped = torch.minimum(loss, -advantages * clip.dual_clip)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, was_clipped


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              seq_index: torch.Tensor, mask: torch.Tensor, clip: ClipConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: one importance ratio per sequence, the geometric mean of its token ratios.

    Token-level form: ``r_t = sg(s_i) * exp(logp_t - sg(logp_t))``, so the value is the sequence ratio
    ``s_i`` and the gradient flows through each token; then clipped like PPO.
    """
    n = int(seq_index.max()) + 1 if seq_index.numel() else 0
    log_ratio = (logprobs - old_logprobs) * mask
    per_seq = torch.zeros(n, dtype=logprobs.dtype, device=logprobs.device).index_add_(0, seq_index, log_ratio)
    lengths = torch.zeros(n, dtype=logprobs.dtype, device=logprobs.device).index_add_(0, seq_index, mask)
    seq_log_ratio = (per_seq / lengths.clamp(min=1.0))[seq_index]
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    return ppo_clip_loss(token_log_ratio, torch.zeros_like(token_log_ratio), advantages, clip)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the categorical distribution given by `logits` ``[T, V]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
