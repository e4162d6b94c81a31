"""Built-in advantage estimators: ``advantages(groups) -> {sample_id: advantage}``, selected by
``train.objective.advantage``.

* ``grpo``: GRPO (Shao et al. 2024, DeepSeekMath): group-relative, per sample.
* ``reinforce_pp``: REINFORCE++ (Hu 2025): discounted per-token returns, whitened over the batch's tokens.
* ``reinforce_pp_baseline``: REINFORCE++ with the group mean as baseline, whitened over the batch's tokens.
* ``gae``: PPO's generalised advantage estimation (Schulman et al. 2016) from a critic's per-token values
  (``train.critic``); it also gives the critic its targets (returns).

Each counts a trajectory (an agent's branches) once and wants one reward per trajectory; branches that
disagree are an error unless ``branch_rewards`` says how to combine them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl
from rlx.errors import RLXError
from rlx.hookspecs import RegisterAdvantages
from rlx.train.advantages import (grpo_advantages, reinforce_pp_advantages, reinforce_pp_baseline_advantages,
                                  trajectories, trajectory_rewards)


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
    """Generalised advantage estimation from a critic's values, per model token (`rlx.train.gae`). It needs
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
        from rlx.train.gae import advantages_and_returns  # torch: when a run builds it, not when the plugins load

        self.config = config
        self._advantages_and_returns = advantages_and_returns

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
        return self._advantages_and_returns(masks, rewards, values, c.gamma, c.lam, c.lam_critic, kl, kl_coef,
                                            c.whiten, c.eps)


@hookimpl
def register_advantages(register: RegisterAdvantages) -> None:
    for cls in (GRPO, ReinforcePP, ReinforcePPBaseline, GAE):
        register(cls)
