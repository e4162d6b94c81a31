"""Built-in policy losses: ``loss(inputs: LossInputs) -> (per_token_loss, clipped)``, selected by
``train.objective.loss``. torch is imported when a loss is used, not when the plugin loads, so that
``rl plugins`` stays fast and works without torch.

* ``ppo_clip``: PPO (Schulman et al. 2017) with clip-higher (DAPO) and dual-clip; token mean by default.
* ``gspo``: GSPO (Zheng et al. 2025): one ratio per sequence; averaged per sequence (``default_norm``).
* ``cispo``: CISPO (MiniMax-M1 2025): the clipped importance weight, detached, times ``A · log p``.

A loss may say which normalisation its paper uses (``default_norm``), used when
``train.objective.loss_norm`` is unset.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl
from rlx.hookspecs import RegisterLosses


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _ClipArgs(_Args):
    eps_low: float = Field(0.2, ge=0)  # ratio floor 1 - eps_low
    eps_high: float = Field(0.28, ge=0)  # ratio ceiling 1 + eps_high (clip-higher)
    dual_clip: float | None = Field(None, gt=1)  # cap for negative advantages (dual-clip PPO)

    def clip(self):
        from rlx.train.losses import ClipConfig  # torch: when a run builds the loss, not when the plugins load

        return ClipConfig(self.eps_low, self.eps_high, self.dual_clip)


class PPOClip:
    """Token-level PPO-clip with asymmetric bounds (clip-higher) and optional dual-clip."""

    name = "ppo_clip"
    Config = _ClipArgs

    def __init__(self, config: _ClipArgs):
        from rlx.train.losses import ppo_clip_loss

        self.clip, self._loss = config.clip(), ppo_clip_loss

    def loss(self, inp):
        return self._loss(inp.logprobs, inp.old_logprobs, inp.advantages, self.clip)


class GSPO:
    """Sequence-level importance ratio (geometric mean over the sequence), clipped like PPO; the paper
    averages sequence losses, so its normalisation is per sequence."""

    name = "gspo"
    default_norm = "sequence"

    class Config(_ClipArgs):
        eps_low: float = Field(3e-4, ge=0)
        eps_high: float = Field(4e-4, ge=0)

    def __init__(self, config: Config):
        from rlx.train.losses import gspo_loss

        self.clip, self._loss = config.clip(), gspo_loss

    def loss(self, inp):
        return self._loss(inp.logprobs, inp.old_logprobs, inp.advantages, inp.seq_index, inp.mask, self.clip)


class CISPO:
    """Clipped IS-weight policy optimisation: every token keeps its gradient, weighted by its clipped,
    detached importance ratio. The paper sets no lower bound (eps_low 1: the weight may fall to 0) and
    tunes only eps_high."""

    name = "cispo"

    class Config(_Args):
        eps_low: float = Field(1.0, ge=0, le=1)  # weight floor 1 - eps_low
        eps_high: float = Field(0.28, ge=0)  # weight ceiling 1 + eps_high

    def __init__(self, config: Config):
        from rlx.train.losses import ClipConfig, cispo_loss

        self.clip, self._loss = ClipConfig(config.eps_low, config.eps_high), cispo_loss

    def loss(self, inp):
        return self._loss(inp.logprobs, inp.old_logprobs, inp.advantages, self.clip)


@hookimpl
def register_losses(register: RegisterLosses) -> None:
    for cls in (PPOClip, GSPO, CISPO):
        register(cls)
