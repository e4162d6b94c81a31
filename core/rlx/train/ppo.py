"""The step of value-based estimators (PPO with a critic): values -> GAE -> critic update -> actor update.

`CriticStep.run` replaces `prepare` + `RLStep.run` when the advantage estimator has a critic
(``needs_critic``, the built-in ``gae``):

1. The critic's values (and, with ``kl_in_reward``, the actor's and the reference model's log-probs) of every
   trainable sample, each data-parallel rank computing its share and every rank receiving them all, so the
   advantages (whitened over the whole batch) are the same everywhere.
2. The estimator's per-token advantages and returns.
3. The critic trains on the returns (value loss, clipped around the values of step 1), on the same
   mini-batches as the actor, before the actor (after it when the critic has ranks of its own: the updates are
   independent); during ``train.critic.warmup_steps`` it trains alone.
4. The actor trains on the advantages with the configured policy loss (`RLStep.run`). With ``kl_in_reward``
   the KL is in the reward and not in the loss.

Choices: the value loss is a token mean over each mini-batch's model tokens (as verl and OpenRLHF do),
whatever ``loss_norm`` the policy uses. Values, advantages and returns exist only at model tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlx.errors import RLXError
from rlx.train.advantages import Norm, explained_variance
from rlx.train.batch import TrainBatch
from rlx.train.losses import kl_penalty, value_loss
from rlx.train.model import ModelRole
from rlx.train.packing import PackedBatch
from rlx.train.step import RLStep, batch_probes, per_token_weights
from rlx.types import RolloutBatch, Sample

if TYPE_CHECKING:
    from rlx.config import Config, TrainConfig
    from rlx.plugins import Plugins
    from rlx.protocols import CriticEstimator
    from rlx.train.lora import AdaptersOff
    from rlx.train.megatron_patches.checkpoint import BackgroundWrites
    from rlx.train.spec import ModelSpec


def response_values(mb: PackedBatch, out: torch.Tensor) -> torch.Tensor:
    """The critic's value at each response token of a packed micro-batch (of the state before the token, at
    the position whose logits predict it, like its log-prob): flat ``[T]``."""
    if out.shape[-1] != 1:
        raise RLXError(f"the critic's model returned {out.shape[-1]} numbers per position, not 1: its output layer "
                       f"is not the value head (does the model bridge's build() keep megatron's output_layer?)")
    return mb.at_response(out)[:, 0].float()


def critic_micro_loss(mb: PackedBatch, out: torch.Tensor, *, tb: TrainBatch, clip: float | None,
                      scale: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The value loss of one micro-batch, weighted per token (`tb.weights` times `scale`)."""
    dev = out.device
    s = mb.samples
    values = response_values(mb, out)
    w = tb.tokens(s, "weights").to(dev) * scale
    per_token, clipped = value_loss(values, tb.tokens(s, "values").to(dev), tb.tokens(s, "returns").to(dev), clip)
    loss = (per_token * w).sum()
    return loss, {"value_loss": float(loss.detach()), "value_clip_frac": float((clipped.float() * w).sum()),
                  "weight": float(w.sum())}


def gather(local: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every rank's per-sample tensors, merged: each sample is computed by one data-parallel rank's last
    stage (its tensor-parallel peers hold the same)."""
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.cpu() for k, v in local.items()})
    out: dict[int, torch.Tensor] = {}
    for p in parts:
        out.update(p)
    return out


class CriticStep:
    """Trains the critic, then the actor, on a rollout batch (see the module's docstring)."""

    def __init__(self, train_cfg: TrainConfig, estimator: CriticEstimator | None, step: RLStep, critic: ModelRole | None,
                 loss_norm: Norm):
        """`critic` None: the critic has ranks of its own, and this side only prepares and trains the actor."""
        self.tc = train_cfg
        self.cc = train_cfg.critic
        self.obj = train_cfg.objective
        self.estimator = estimator
        self.step = step
        self._critic = critic
        self.loss_norm = loss_norm

    @property
    def critic(self) -> ModelRole:
        if self._critic is None:
            raise RLXError("the critic has ranks of its own (train.critic.parallel): this side holds no critic")
        return self._critic

    @torch.no_grad()
    def values(self, samples: list[Sample]) -> dict[int, torch.Tensor]:
        """Every sample's per-response-token values (each rank computing its data-parallel share)."""

        def collect(mb: PackedBatch, out: torch.Tensor):
            v = response_values(mb, out).cpu()
            return dict(zip((s.sample_id for s in mb.samples), v.split([len(s.response_ids) for s in mb.samples]),
                            strict=True))

        local: dict[int, torch.Tensor] = {}
        for part in self.critic.schedule(self.step.packed(self.step.my_share(samples)), collect, forward_only=True):
            local.update(part)
        return gather(local)

    def prepare(self, batch: RolloutBatch, actor: ModelRole, reference: ModelRole | AdaptersOff | None,
                values: dict[int, torch.Tensor] | None = None) -> TrainBatch:
        """Advantages and returns of the batch (on the actor's ranks), from `values` (the critic's, when it has
        ranks of its own) or the critic beside the actor."""
        samples = scored(batch)
        groups = [g for g in batch.groups if g.trainable]
        if values is None:
            values = self.values(samples)
        kl = None
        metrics = batch_probes(samples)
        if self.obj.kl_in_reward:
            if reference is None:
                raise RLXError("train.objective.kl_in_reward needs a reference model: set kl_coef > 0")
            mine = self.step.my_share(samples)
            old = gather(self.step.logprobs(actor, mine))
            ref = gather(self.step.logprobs(reference, mine))
            kl = {sid: kl_penalty(old[sid], ref[sid], self.obj.kl_type, old[sid]) for sid in old}  # no gradient
            model = torch.cat([kl[s.sample_id][TrainBatch.loss_mask([s]) > 0] for s in samples])
            metrics["kl"] = float(model.mean()) if model.numel() else 0.0
        if self.estimator is None:
            raise RLXError("the critic's own ranks make no advantages: the actor's ranks do (train_actor)")
        adv, ret = self.estimator.advantages_and_returns(
            groups, {sid: v.tolist() for sid, v in values.items()},
            {sid: v.tolist() for sid, v in kl.items()} if kl is not None else None, self.obj.kl_coef)
        samples = [s for s in samples if s.sample_id in adv]
        groups = [g for g in groups if any(s.sample_id in adv for s in g.trainable)]
        tb = TrainBatch(batch.step, groups, samples,
                        advantages={sid: torch.tensor(a, dtype=torch.float32) for sid, a in adv.items()},
                        weights=per_token_weights(groups, samples, self.loss_norm), returns={sid: torch.tensor(r, dtype=torch.float32) for sid, r in ret.items()},
                        values=values, metrics=metrics)
        tb.metrics.update(self._value_metrics(tb))
        return tb

    @staticmethod
    def _value_metrics(tb: TrainBatch) -> dict[str, float]:
        model = TrainBatch.loss_mask(tb.samples) > 0
        v, r = tb.tokens(tb.samples, "values")[model].tolist(), tb.tokens(tb.samples, "returns")[model].tolist()
        return {"critic/value_mean": sum(v) / len(v) if v else 0.0,
                "critic/returns_mean": sum(r) / len(r) if r else 0.0,
                "critic/explained_variance": explained_variance(v, r)}

    def train_critic(self, tb: TrainBatch) -> dict[str, float]:
        """The critic's updates on the step's mini-batches; its metrics (global)."""
        updates = self.tc.updates_per_step
        total = sum(sum(s.loss_mask) for s in tb.samples) or 1
        token_mean = {s.sample_id: torch.tensor(s.loss_mask, dtype=torch.float32) / total for s in tb.samples}
        critic_tb = TrainBatch(tb.step, tb.groups, tb.samples, tb.advantages, token_mean, tb.returns, tb.values)
        minis, scales = self.step.mini_batches(critic_tb)
        vals = self.step.update(
            self.critic, minis, scales,
            lambda scale: functools.partial(critic_micro_loss, tb=critic_tb, clip=self.cc.value_clip, scale=scale),
            ["value_loss", "value_clip_frac", "weight", "grad_norm"], loss_key="value_loss", what="value loss",
            who="critic")
        return {"critic/value_loss": vals["value_loss"] / updates,
                "critic/value_clip_frac": vals["value_clip_frac"] / (vals["weight"] or 1.0),
                "critic/grad_norm": vals["grad_norm"],
                "critic/lr": self.critic.lr}

    def train_actor(self, tb: TrainBatch, actor: ModelRole, reference: ModelRole | AdaptersOff | None,
                    step_index: int) -> dict[str, float | None]:
        """The actor's updates (none during the critic's warm-up); the step's metrics but the critic's."""
        metrics: dict[str, float | None] = {}
        if step_index < self.cc.warmup_steps:
            metrics.update(tb.metrics)
            metrics["critic/warmup"] = 1.0
            metrics.update(loss=None, pg_loss=None, entropy=None)  # the policy did not train: nothing to report
            metrics["samples"] = float(len(tb.samples))
            metrics["tokens"] = float(sum(s.total_len for s in tb.samples))
            return metrics
        kl = tb.metrics.pop("kl", None)
        metrics.update(self.step.run(tb, actor, None if self.obj.kl_in_reward else reference))
        if kl is not None:
            metrics["kl"] = kl
        metrics["critic/warmup"] = 0.0
        return metrics

    def run(self, batch: RolloutBatch, actor: ModelRole, reference: ModelRole | AdaptersOff | None, step_index: int,
            hold_actor: Callable[[], None], hold_critic: Callable[[], None]) -> dict[str, float | None]:
        """Critic, then (after the warm-up) actor, in the same ranks; global metrics. `hold_actor` and
        `hold_critic` make one side resident on the device (`rlx.train.offload`) before it works."""
        samples = scored(batch)
        hold_critic()
        values = self.values(samples)
        if self.obj.kl_in_reward:
            hold_actor()  # the actor's and the reference model's log-probs go into the reward
        tb = self.prepare(batch, actor, reference, values)
        hold_critic()
        critic = self.train_critic(tb)
        hold_actor()
        return {**critic, **self.train_actor(tb, actor, reference, step_index)}


def check_critic_model(critic: ModelSpec, actor: ModelSpec, path: str | Path) -> None:
    """The critic reads the policy's tokens: the same architecture and vocabulary (it may differ in weights)."""
    if critic.model_type != actor.model_type or critic.vocab_size != actor.vocab_size:
        raise RLXError(f"train.critic.model_path: {path} is a {critic.model_type!r} model with a vocabulary of "
                       f"{critic.vocab_size}; the critic reads the policy's tokens, so it must be a "
                       f"{actor.model_type!r} model with the policy's vocabulary of {actor.vocab_size}")


def scored(batch: RolloutBatch) -> list[Sample]:
    """The batch's trainable samples that have a reward: what the critic values and trains on."""
    samples = [s for g in batch.groups if g.trainable for s in g.trainable if s.reward is not None]
    if not samples:
        raise RLXError(f"step {batch.step}: no trainable samples (all failed or filtered)")
    return samples


class CriticTrainer:
    """The critic in ranks of its own (``train.critic.parallel``): one rank of its megatron world, which is not
    the actor's. The group calls `values`, then (with the actor's returns) `train`."""

    def __init__(self, cfg: Config, plugins: Plugins, master_addr: str = "127.0.0.1"):
        from rlx.config import trainer_offloads
        from rlx.models.tiny import resolve_model_path
        from rlx.train.kernel_choice import matmul_choice, use_matmul
        from rlx.train.offload import Residency
        from rlx.train.model import device, init_distributed, torch_dtype
        from rlx.train.spec import model_spec
        from rlx.train.step import RLStep

        tc = cfg.train
        parallel = tc.critic.parallel
        if parallel is None:
            raise RLXError("a critic with ranks of its own needs train.critic.parallel")
        self.par = init_distributed(parallel, cfg.run.seed, master_addr, key="train.critic.parallel",
                                    deterministic=cfg.run.deterministic)
        path = resolve_model_path(tc.critic.model_path or cfg.model.path)
        self.spec = model_spec(path, plugins, cfg.model.kernels)
        use_matmul(plugins, matmul_choice(cfg.model.kernels), device(), torch_dtype(cfg.model.dtype),
                   self.spec.hidden_size)
        check_critic_model(self.spec, model_spec(resolve_model_path(cfg.model.path), plugins), path)
        self.critic = ModelRole("critic", self.spec, self.par, parallel, torch_dtype(cfg.model.dtype), value_head=True)
        self.critic.load_hf(path)
        self.critic.start_training(tc.critic.optim, tc.num_steps * tc.updates_per_step)
        step = RLStep(tc, None, plugins.build("balancers", tc.balancer), self.spec.flops, self.par)
        self.step_fn = CriticStep(tc, None, step, self.critic, "token")
        self.memory = Residency(trainer_offloads(cfg), {"critic": self.critic}, device())
        self.memory.hold()

    def values(self, batch: RolloutBatch) -> dict[int, torch.Tensor]:
        self.memory.hold(critic="all")
        try:
            return self.step_fn.values(scored(batch))
        finally:
            self.memory.hold()  # the actor's ranks train next

    def train(self, batch: RolloutBatch, returns: dict[int, torch.Tensor],
              values: dict[int, torch.Tensor]) -> dict[str, float]:
        samples = [s for s in scored(batch) if s.sample_id in returns]
        groups = [g for g in batch.groups if any(s.sample_id in returns for s in g.trainable)]
        tb = TrainBatch(batch.step, groups, samples, advantages={}, weights={}, returns=returns, values=values)
        self.memory.hold(critic="all")
        try:
            return self.step_fn.train_critic(tb)
        finally:
            self.memory.hold()

    def save(self, folder: Path, writes: BackgroundWrites | None = None) -> None:
        self.memory.hold(critic="all")
        self.critic.save(folder, writes)
        self.memory.hold()

    def load(self, folder: Path) -> None:
        self.memory.hold(critic="all")
        self.critic.load(folder)
        self.memory.hold()
