"""The training objective of one micro-batch: policy loss, KL penalty, entropy bonus and truncated
importance sampling, each weighted per token so that micro-batches add up to the global loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlx.train.losses import KLType, kl_penalty, tis_weights


@dataclass
class LossInputs:
    """Flat per-token tensors ``[T]`` of one packed micro-batch (response tokens only)."""

    logprobs: torch.Tensor  # current policy, with grad
    old_logprobs: torch.Tensor  # trainer's, before this update
    rollout_logprobs: torch.Tensor  # the engine's
    advantages: torch.Tensor
    weights: torch.Tensor  # normalisation weight per token, 0 where the loss mask is 0
    mask: torch.Tensor  # 1.0 on model-sampled tokens
    seq_index: torch.Tensor  # sequence (0..n-1) of each token, for sequence-level losses
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


@dataclass
class ObjectiveConfig:
    kl_coef: float = 0.0  # weight of the KL penalty against the reference policy (0: off)
    kl_type: KLType = "low_var"
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    tis_cap: float | None = None  # importance sampling cap (None: off)
    tis_mode: str = "truncate"  # "truncate": cap the weights; "mask": zero the tokens above the cap


def metric_keys(kl: bool, entropy: bool) -> list[str]:
    """The metrics `objective` returns, given whether reference log-probs and entropy are passed in."""
    return (["pg_loss", "clip_frac", "tis_weight", "tis_masked", "train_rollout_logprob_diff", "weight", "loss"]
            + (["kl"] if kl else []) + (["entropy"] if entropy else []))


def objective(inp: LossInputs, policy_loss: Any, cfg: ObjectiveConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss to back-propagate and weighted metric sums (divide by the weight sum to average)."""
    w = inp.weights
    per_token, clipped = policy_loss(inp)
    if cfg.tis_cap is not None:
        tis = tis_weights(inp.old_logprobs, inp.rollout_logprobs, cfg.tis_cap, cfg.tis_mode)
        per_token = per_token * tis
    else:
        tis = torch.ones_like(per_token)
    pg = (per_token * w).sum()
    loss = pg
    metrics = {
        "pg_loss": float(pg.detach()),
        "clip_frac": float((clipped.float() * w).sum()),
        "tis_weight": float((tis * w).sum()),
        "tis_masked": float(((tis == 0).float() * w).sum()),
        "train_rollout_logprob_diff": float(((inp.old_logprobs - inp.rollout_logprobs).abs() * w).sum()),
        "weight": float(w.sum()),
    }
    if inp.ref_logprobs is not None:
        kl = (kl_penalty(inp.logprobs, inp.ref_logprobs, cfg.kl_type) * w).sum()
        metrics["kl"] = float(kl.detach())
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * kl
    if inp.entropy is not None:
        ent = (inp.entropy * w).sum()
        metrics["entropy"] = float(ent.detach())
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent
    metrics["loss"] = float(loss.detach())
    return loss, metrics
