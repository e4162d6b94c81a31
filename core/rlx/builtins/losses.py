"""Built-in policy losses (ppo_clip, gspo): ``loss(inputs: LossInputs) -> (per_token_loss, clipped)``,
selected by ``train.objective.loss``. torch is imported when a loss is used, not when the plugin loads,
so that ``rl plugins`` stays fast and works without torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _ClipArgs(_Args):
    eps_low: float = Field(0.2, ge=0)  # ratio floor 1 - eps_low
    eps_high: float = Field(0.28, ge=0)  # ratio ceiling 1 + eps_high (clip-higher)
    dual_clip: float | None = Field(None, gt=1)  # cap for negative advantages (dual-clip PPO)

    def clip(self):
        from rlx.train.losses import ClipConfig

        return ClipConfig(self.eps_low, self.eps_high, self.dual_clip)


class PPOClip:
    """Token-level PPO-clip with asymmetric bounds (clip-higher) and optional dual-clip."""

    name = "ppo_clip"
    Config = _ClipArgs

    def __init__(self, config: _ClipArgs):
        self.clip = config.clip()

    def loss(self, inp):
        from rlx.train.losses import ppo_clip_loss

        return ppo_clip_loss(inp.logprobs, inp.old_logprobs, inp.advantages, self.clip)


class GSPO:
    """Sequence-level importance ratio (geometric mean over the sequence), clipped like PPO."""

    name = "gspo"

    class Config(_ClipArgs):
        eps_low: float = Field(3e-4, ge=0)
        eps_high: float = Field(4e-4, ge=0)

    def __init__(self, config: Config):
        self.clip = config.clip()

    def loss(self, inp):
        from rlx.train.losses import gspo_loss

        return gspo_loss(inp.logprobs, inp.old_logprobs, inp.advantages, inp.seq_index, inp.mask, self.clip)


@hookimpl
def register_losses(register):
    register(PPOClip)
    register(GSPO)
