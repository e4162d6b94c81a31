"""Built-in advantage estimators (grpo, reinforce_pp): ``advantages(groups) -> {sample_id: advantage}``,
selected by ``train.objective.advantage``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from rlx import hookimpl


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GRPO:
    """Group-relative advantages: each reward minus its group's mean, over the group's std."""

    name = "grpo"

    class Config(_Args):
        normalize_std: bool = True  # off: Dr. GRPO style, no division by the group std

    def __init__(self, config: Config):
        self.config = config

    def advantages(self, groups):
        from rlx.train.advantages import grpo_advantages

        return grpo_advantages(groups, self.config.normalize_std)


class ReinforcePP:
    """REINFORCE++ with a baseline: group mean subtracted, then whitened over the batch."""

    name = "reinforce_pp"

    def advantages(self, groups):
        from rlx.train.advantages import reinforce_pp_advantages

        return reinforce_pp_advantages(groups)


@hookimpl
def register_advantages(register):
    register(GRPO)
    register(ReinforcePP)
