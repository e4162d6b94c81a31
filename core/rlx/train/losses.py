"""Policy losses and the per-token terms beside them, as plain functions over flat per-token tensors, and the
built-in losses (``train.objective.loss``), each ``loss(inputs: LossInputs) -> (per_token_loss, clipped)``:

* ``ppo_clip``: PPO (Schulman et al. 2017) with clip-higher (DAPO) and dual-clip; token mean by default.
* ``gspo``: GSPO (Zheng et al. 2025): one ratio per sequence; averaged per sequence (``default_norm``).
* ``cispo``: CISPO (MiniMax-M1 2025): the clipped importance weight, detached, times ``A · log p``.

A loss may say which normalisation its paper uses (``default_norm``), used when ``train.objective.loss_norm`` is
unset. The critic's value loss is here too (`value_loss`).

Choices:

* Every tensor is flat over the tokens of a micro-batch (packed, no padding): ``[T]``. ``seq_index``
  says which sequence a token belongs to.
* Normalisation arrives as a per-token weight (`rlx.train.advantages.token_weights`), so a micro-batch's
  loss is ``sum(weight * per_token_loss)``.
* Log-probs: ``logprobs`` are the current policy's (with grad), ``old_logprobs`` the trainer's before
  this update, ``rollout_logprobs`` the engine's (where it reported them). All are of the distribution
  the engine sampled from (logits over the sampling temperature). Importance sampling corrects for the
  gap between engine and trainer (`importance_ratio`, `tis_weights`), with no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl
from rlx.hookspecs import RegisterLosses
from rlx.lazy import lazy_module
from rlx.protocols import LossInputs

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # the plugins load this module without torch (`rlx.lazy`)

KLType = Literal["k1", "k2", "k3", "low_var", "unbiased"]


# -- per-token terms -----------------------------------------------------------------------------


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType,
               old_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1, k2, k3).

    ``low_var`` is k3 clamped to [-10, 10]. ``unbiased`` is k3 times the importance ratio of the current
    policy to the one that sampled (``old_logprobs``), which makes its gradient an unbiased estimate of
    the KL's gradient off-policy (DeepSeek-V3.2, eq. 7).
    """
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
    if kind == "unbiased":
        if old_logprobs is None:
            raise ValueError("the unbiased KL needs the sampling policy's log-probs")
        return torch.exp(logprobs - old_logprobs) * k3
    raise ValueError(f"unknown KL type {kind!r}")


def importance_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, has_rollout: torch.Tensor,
                     level: str = "token", seq_index: torch.Tensor | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Trainer over engine probability of each token (no gradient): per token, or one per sequence (the
    product of its tokens' ratios, ``sequence``, or their geometric mean, ``geometric``), spread over the
    sequence's tokens. Tokens without engine log-probs get 1 and do not enter sequence ratios."""
    log_ratio = ((old_logprobs - rollout_logprobs) * has_rollout).detach()
    if level == "token":
        return torch.exp(log_ratio)
    if level not in ("sequence", "geometric"):
        raise ValueError(f"importance sampling level must be token, sequence or geometric, not {level!r}")
    assert seq_index is not None and mask is not None
    counted = mask * has_rollout
    n = int(seq_index.max()) + 1 if seq_index.numel() else 0
    per_seq = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, seq_index,
                                                                                         log_ratio * counted)
    if level == "geometric":
        tokens = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, seq_index, counted)
        per_seq = per_seq / tokens.clamp(min=1.0)
    return torch.exp(per_seq)[seq_index]


def tis_weights(ratio: torch.Tensor, cap: float, mode: str = "truncate", low: float | None = None) -> torch.Tensor:
    """Importance weights from engine-vs-trainer ratios (no gradient).

    ``truncate``: the ratio clamped to ``[low, cap]`` (TIS; no lower bound when `low` is None).
    ``mask``: the ratio where it lies in ``[low, cap]``, 0 outside (masked importance sampling; with a
    lower bound, two-sided as in IcePop): tokens the engine sampled far off the trainer's policy add nothing.
    """
    ratio = ratio.detach()
    lo = 0.0 if low is None else low
    if mode == "truncate":
        return ratio.clamp(min=lo, max=cap)
    if mode == "mask":
        return torch.where((ratio <= cap) & (ratio >= lo), ratio, torch.zeros_like(ratio))
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


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               clip: ClipConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, eq. 4): ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log p``: the importance
    weight is clipped and detached, so every token keeps its gradient (none is clipped out)."""
    ratio = torch.exp(logprobs - old_logprobs).detach()
    weight = ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high)
    return -weight * advantages * logprobs, weight != ratio


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


# -- the built-in losses -------------------------------------------------------------------------


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _ClipArgs(_Args):
    eps_low: float = Field(0.2, ge=0)  # ratio floor 1 - eps_low
    eps_high: float = Field(0.28, ge=0)  # ratio ceiling 1 + eps_high (clip-higher)
    dual_clip: float | None = Field(None, gt=1)  # cap for negative advantages (dual-clip PPO)

    def clip(self) -> ClipConfig:
        return ClipConfig(self.eps_low, self.eps_high, self.dual_clip)


class PPOClip:
    """Token-level PPO-clip with asymmetric bounds (clip-higher) and optional dual-clip."""

    name = "ppo_clip"
    Config = _ClipArgs

    def __init__(self, config: _ClipArgs):
        self.clip = config.clip()

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return ppo_clip_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages, self.clip)


class GSPO:
    """Sequence-level importance ratio (geometric mean over the sequence), clipped like PPO; the paper
    averages sequence losses, so its normalisation is per sequence."""

    name = "gspo"
    default_norm = "sequence"

    class Config(_ClipArgs):
        eps_low: float = Field(3e-4, ge=0)
        eps_high: float = Field(4e-4, ge=0)

    def __init__(self, config: Config):
        self.clip = config.clip()

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return gspo_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.seq_index, inputs.mask, self.clip)


class CISPO:
    """Clipped IS-weight policy optimisation: every token keeps its gradient, weighted by its clipped,
    detached importance ratio. The paper sets no lower bound (eps_low 1: the weight may fall to 0) and
    tunes only eps_high."""

    name = "cispo"

    class Config(_Args):
        eps_low: float = Field(1.0, ge=0, le=1)  # weight floor 1 - eps_low
        eps_high: float = Field(0.28, ge=0)  # weight ceiling 1 + eps_high

    def __init__(self, config: Config):
        self.clip = ClipConfig(config.eps_low, config.eps_high)

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return cispo_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages, self.clip)


@hookimpl
def register_losses(register: RegisterLosses) -> None:
    for cls in (PPOClip, GSPO, CISPO):
        register(cls)
