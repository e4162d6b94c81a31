"""Built-in advantage estimators: ``advantages(groups) -> {sample_id: advantage}``, selected by
``train.objective.advantage``.

* ``grpo``: GRPO (Shao et al. 2024, DeepSeekMath): group-relative, per sample.
* ``reinforce_pp``: REINFORCE++ (Hu 2025): discounted per-token returns, whitened over the batch's tokens.
* ``reinforce_pp_baseline``: REINFORCE++ with the group mean as baseline, whitened over the batch's tokens.

Each counts a trajectory (an agent's branches) once and wants one reward per trajectory; branches that
disagree are an error unless ``branch_rewards`` says how to combine them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl


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
        from rlx.train.advantages import grpo_advantages

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
        from rlx.train.advantages import reinforce_pp_advantages

        c = self.config
        return reinforce_pp_advantages(groups, c.gamma, c.eps, c.branch_rewards)


class ReinforcePPBaseline:
    """REINFORCE++ with a baseline: the reward minus its group's mean, whitened over the batch's tokens."""

    name = "reinforce_pp_baseline"
    Config = _Args

    def __init__(self, config: _Args):
        self.config = config

    def advantages(self, groups):
        from rlx.train.advantages import reinforce_pp_baseline_advantages

        return reinforce_pp_baseline_advantages(groups, self.config.eps, self.config.branch_rewards)


@hookimpl
def register_advantages(register):
    for cls in (GRPO, ReinforcePP, ReinforcePPBaseline):
        register(cls)
