"""The RL step: advantages -> per-token weights -> objective, over the model roles of one rank.

`prepare` turns a rollout batch into a `TrainBatch` (the same on every rank: the trainable samples,
their per-token advantages and normalisation weights); `RLStep.run` splits it into mini-batches (one
optimizer update each) and data-parallel shares, computes what the objective needs from other roles
(old and reference log-probs), and trains the actor. The roles (`rlx.train.model`) know nothing of RL.

Choices:

* Normalisation is a per-token weight over the whole global batch, so micro-batches and data-parallel
  ranks add up to exactly the global loss; gradients are summed over ranks, not averaged.
* Mini-batches are cut from the global batch before the data-parallel split, so every update sees the
  same samples whatever the number of ranks.
* Old log-probs: with one update per step they equal the current ones (the ratio is exactly 1 at the
  start), so no extra forward pass; with more updates they are computed before the first one.
* Pipeline parallelism: every rank of a stage holds the whole batch and cuts the same micro-batches,
  so all stages agree on their number and order; only the last stage computes losses and log-probs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast, get_args

import torch
import torch.distributed as dist

from rlx.errors import RLXError
from rlx.train.advantages import Norm, token_weights
from rlx.train.balance import FlopsModel
from rlx.train.batch import TrainBatch
from rlx.train.distill import distill_advantages
from rlx.train.model import ModelRole, ParallelState
from rlx.train.objective import MAX_KEYS, metric_keys, micro_loss, response_logprobs
from rlx.train.packing import PackedBatch, micro_batches, pack
from rlx.types import Group, RolloutBatch, Sample

T = TypeVar("T")

if TYPE_CHECKING:
    from rlx.config import ObjectiveConfig, TrainConfig
    from rlx.protocols import AdvantageEstimator, Balancer, PolicyLoss
    from rlx.train.lora import AdaptersOff


def prepare(batch: RolloutBatch, estimator: AdvantageEstimator, loss_norm: Norm, multi: bool = False) -> TrainBatch:
    """Advantages and normalisation weights of every trainable sample of the batch (`multi`, multi-LoRA: each
    adapter's samples on their own, as if they were a batch of their own, `by_adapter`)."""
    groups = [g for g in batch.groups if g.trainable]
    if multi and any(s.lora is None for g in groups for s in g.samples):
        raise RLXError(f"step {batch.step}: a sample without an adapter (Sample.lora) reached the trainer of "
                       f"train.lora.adapters (a replay of batches from a run without them?)")
    adv: dict[int, Any] = {}
    for part in by_adapter(groups, lambda g: g.samples[0].lora if multi else None):
        got = estimator.advantages(part)
        if not isinstance(got, Mapping):
            raise RLXError(f"advantage estimator {getattr(estimator, 'name', estimator)!r} returned "
                           f"{type(got).__name__}; the contract is a mapping sample_id -> advantage")
        adv.update(got)
    groups = [g for g in groups if any(s.sample_id in adv for s in g.trainable)]
    samples = [s for g in groups for s in g.trainable if s.sample_id in adv]
    if not samples:
        raise RLXError(f"step {batch.step}: no trainable samples (all failed or filtered)")
    advantages = {s.sample_id: _per_token(adv[s.sample_id], s, estimator) for s in samples}
    return TrainBatch(batch.step, groups, samples, advantages, per_token_weights(groups, samples, loss_norm, multi),
                      metrics=batch_probes(samples))


def per_token_weights(groups: list[Group], samples: list[Sample], loss_norm: Norm, multi: bool = False
                      ) -> dict[int, torch.Tensor]:
    """Each sample's normalisation weight per response token (`token_weights`; `multi`, multi-LoRA: over its adapter's
    samples, so that each adapter's loss is the mean over its own), 0 where the loss mask is 0."""
    w: dict[int, float] = {}
    for part in by_adapter(groups, lambda g: g.samples[0].lora if multi else None):
        w.update(token_weights(part, loss_norm))
    return {s.sample_id: torch.tensor(s.loss_mask, dtype=torch.float32) * w[s.sample_id] for s in samples}


def by_adapter(items: list[T], adapter: Callable[[T], str | None]) -> list[list[T]]:
    """`items` (groups, samples) by their multi-LoRA adapter (`Sample.lora`), in order of first appearance, each part
    in its order; one part without adapters."""
    parts: dict[str | None, list[T]] = {}
    for x in items:
        parts.setdefault(adapter(x), []).append(x)
    return list(parts.values())


def batch_probes(samples: list[Sample]) -> dict[str, float]:
    """What every run reports about the data it trains on: samples without engine log-probs (no importance
    correction for them), and for agent samples whether every trained token is one the engine sampled."""
    out = {"rollout_logprobs_missing": float(sum(s.rollout_logprobs is None for s in samples))}
    agent = [s for s in samples if "sampled_tokens" in s.metadata]
    if agent:
        # tokens masked for staleness were sampled, and deliberately not trained
        trained = [sum(s.loss_mask) + int(s.metadata.get("stale_masked_tokens", 0)) for s in agent]
        sampled = [int(s.metadata["sampled_tokens"]) for s in agent]
        out["tito/trained_tokens"] = float(sum(trained))
        out["tito/sampled_tokens"] = float(sum(sampled))
        out["tito/mismatched_samples"] = float(sum(a != b for a, b in zip(trained, sampled, strict=True)))
    return out


def mini_batch_scales(tb: TrainBatch, cuts: list[list[Sample]]) -> list[float]:
    """Per update, the factor that makes its mini-batch's normalisation weights sum to one: each update
    optimises the mean over its own mini-batch (as PPO does), not its share of the step's. One update: 1."""
    if len(cuts) == 1:
        return [1.0]
    return [1.0 / (sum(float(tb.weights[s.sample_id].sum()) for s in cut) or 1.0) for cut in cuts]


def loss_norm(objective_cfg: ObjectiveConfig, policy_loss: PolicyLoss) -> Norm:
    """``train.objective.loss_norm``, or when unset the policy loss's own (``default_norm``; token)."""
    norm = objective_cfg.loss_norm or getattr(policy_loss, "default_norm", "token")
    if norm not in get_args(Norm):
        raise RLXError(f"policy loss {type(policy_loss).__name__}: default_norm {norm!r} is none of {get_args(Norm)}")
    return cast(Norm, norm)


def _per_token(value: float | Sequence[float], s: Sample, estimator: AdvantageEstimator) -> torch.Tensor:
    n = len(s.response_ids)
    t = torch.as_tensor(value, dtype=torch.float32)
    if t.ndim == 0:  # one advantage for the whole sample (a float, a numpy or 0-d torch scalar)
        return t.expand(n).clone()
    t = t.flatten()
    if t.numel() != n:
        raise RLXError(f"advantage estimator {getattr(estimator, 'name', estimator)!r} gave sample "
                       f"{s.sample_id} {t.numel()} advantages for {n} response tokens")
    return t


class RLStep:
    """Trains the actor on a `TrainBatch` with the configured objective."""

    def __init__(self, train_cfg: TrainConfig, policy_loss: PolicyLoss | None, balancer: Balancer, flops: FlopsModel,
                 par: ParallelState):
        self.tc = train_cfg
        self.obj = train_cfg.objective
        self.policy_loss = policy_loss
        self.balancer = balancer
        self.flops = flops
        self.par = par
        self.multi = train_cfg.lora is not None and bool(train_cfg.lora.adapters)  # multi-LoRA

    def packed(self, samples: list[Sample]) -> list[PackedBatch]:
        """`samples` packed into micro-batches; each holds one adapter's (multi-LoRA: the forward uses its adapter)."""
        parts = by_adapter(samples, lambda s: s.lora) if self.multi else [samples]
        return [pack([part[i] for i in idx], self.tc.row_tokens) for part in parts
                for idx in micro_batches([s.total_len for s in part], self.tc.max_tokens_per_micro_batch)]

    def my_share(self, samples: list[Sample]) -> list[Sample]:
        parts = self.balancer.partition([s.total_len for s in samples], self.par.dp, self.flops)
        return [samples[i] for i in parts[self.par.dp_rank]]

    @torch.no_grad()
    def logprobs(self, role: ModelRole | AdaptersOff, samples: list[Sample]) -> dict[int, torch.Tensor]:
        """Per-token log-probs of each sample's response under `role` ({} on stages before the last)."""

        def collect(mb: PackedBatch, logits: torch.Tensor):
            lp = response_logprobs(mb, logits, entropy=False)[0].cpu()
            return dict(zip((s.sample_id for s in mb.samples),
                            lp.split([len(s.response_ids) for s in mb.samples]), strict=True))

        out: dict[int, torch.Tensor] = {}
        for part in role.schedule(self.packed(samples), collect, forward_only=True):
            out.update(part)
        return out

    def check_finite(self, loss: float, update: int, updates: int, what: str = "loss", role: str = "policy") -> None:
        """Stop before an optimizer step on a NaN/inf loss (on any rank: all agree, none is left waiting in a
        collective), so the weights stay as they were and the error names the loss, not weight sync."""
        bad = torch.tensor([0.0 if math.isfinite(loss) else 1.0], dtype=torch.float64)
        dist.all_reduce(bad)
        if bad.item():
            applied = (f"updates 1 to {update - 1} of this step were applied to the {role}, this one was not"
                       if update > 1 else f"the {role}'s weights were not changed")
            look = ("the step's rewards and advantages, log-probs (train_rollout_logprob_diff)" if role == "policy"
                    else "the step's rewards and the critic's values and returns")
            raise RLXError(f"the {what} is not finite (NaN or inf) in update {update} of {updates} of this step; "
                           f"{applied}. Look at {look} and the learning rate")

    def mini_batches(self, tb: TrainBatch) -> tuple[list[list[Sample]], list[float]]:
        """The step's mini-batches (one optimizer update each) as this rank's shares, and each one's scale."""
        updates = self.tc.updates_per_step
        cuts = [tb.samples[i::updates] for i in range(updates)]
        if updates > 1 and self.multi:  # multi-LoRA: each adapter's part its own mean
            for cut in cuts:
                for part in by_adapter(cut, lambda s: s.lora):
                    total = sum(float(tb.weights[s.sample_id].sum()) for s in part) or 1.0
                    for s in part:
                        tb.weights[s.sample_id] = tb.weights[s.sample_id] / total
            return [self.my_share(g) for g in cuts], [1.0] * updates
        return [self.my_share(g) for g in cuts], mini_batch_scales(tb, cuts)

    def update(self, role: ModelRole, minis: list[list[Sample]], scales: list[float],
               loss_at: Callable[[float], Callable], keys: list[str], maxes: Sequence[str] = (),
               loss_key: str = "loss", what: str = "loss", who: str = "policy",
               divisors: Sequence[int] | None = None) -> dict[str, float]:
        """The update loop of every trained role (the actor's policy loss, the critic's value loss): one optimizer
        update of `role` per mini-batch, its micro-batches' loss `loss_at(scale)`. Returns the micro-batch
        metrics in `keys` summed over micro-batches, updates and ranks (tensor-parallel repeats counted once; every
        rank reduces the same keys, whether or not its stage computes losses), each update's divided by its
        `divisors` entry (multi-LoRA: the adapters in its mini-batch, each of whose losses is a mean), ``grad_norm``
        averaged over the updates, and the maxima of the `maxes` keys."""
        totals = dict.fromkeys(keys, 0.0)
        top = dict.fromkeys(maxes, 0.0)
        for update, (mini, scale) in enumerate(zip(minis, scales, strict=True), start=1):
            role.zero_grad()
            loss = 0.0
            per = divisors[update - 1] if divisors else 1
            for m in role.schedule(self.packed(mini), loss_at(scale), forward_only=False):
                loss += m.get(loss_key, 0.0)
                for k, v in m.items():
                    if k in top:
                        top[k] = max(top[k], v)
                    else:
                        totals[k] += v / per
            self.check_finite(loss, update, len(minis), what, who)
            totals["grad_norm"] += role.optimizer_step() / self.par.world
        t = torch.tensor([totals[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)  # sum over ranks; TP ranks repeat the same numbers, other stages add zeros
        vals = dict(zip(keys, (t / self.par.tp).tolist(), strict=True))
        vals["grad_norm"] = vals["grad_norm"] * self.par.tp / len(minis)
        if maxes:
            most = torch.tensor([top[k] for k in maxes], dtype=torch.float64)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            vals.update(zip(maxes, most.tolist(), strict=True))
        return vals

    def run(self, tb: TrainBatch, actor: ModelRole, reference: ModelRole | AdaptersOff | None) -> dict[str, float | None]:
        """Train `actor` on the batch; returns global metrics (sums over ranks made means)."""
        policy_loss = self.policy_loss
        if policy_loss is None:
            raise RLXError("this step has no policy loss: a critic's own ranks train the value, not the policy")
        updates = self.tc.updates_per_step
        minis, scales = self.mini_batches(tb)
        mine = [s for m in minis for s in m]
        if reference is not None:
            tb.ref_logprobs = self.logprobs(reference, mine)
        if updates > 1:
            tb.old_logprobs = self.logprobs(actor, mine)
        distill = self.obj.distill
        if distill is not None and distill.estimator == "token":
            distill_advantages(tb, distill.coef)
        if distill is not None and distill.estimator == "top_k" and any(
                s.teacher is not None and not s.teacher.top_ids for s in tb.samples):
            raise RLXError(f"step {tb.step}: train.objective.distill.estimator is top_k, and samples carry their "
                           f"teacher's log-probs without its top-k (scored for the token estimator: a replay of "
                           f"such a run's batches distils with estimator: token)")
        keys = [k for k in (*metric_keys(kl=reference is not None, entropy=True, mtp=self.obj.mtp_loss_coef > 0,
                                         distill_top_k=distill is not None and distill.estimator == "top_k"),
                            "grad_norm") if k not in MAX_KEYS]
        vals = self.update(actor, minis, scales,
                           lambda scale: functools.partial(micro_loss, tb=tb, policy_loss=policy_loss, cfg=self.obj,
                                                           diff_threshold=self.tc.logprob_diff_threshold, scale=scale),
                           keys, MAX_KEYS, divisors=[len({s.lora for s in tb.samples[i::updates]})
                                                     for i in range(updates)] if self.multi else None)
        w = vals.pop("weight") or 1.0
        # Losses are per-update means (summed over updates); the rest are weighted sums: make them means.
        metrics: dict[str, float | None] = {k: vals[k] / updates for k in ("loss", "pg_loss", "kl", "mtp_loss")
                                             if k in vals}
        for k in ("clip_frac", "tis_weight", "tis_masked", "entropy", "distill_topk_kl"):
            if k in vals:
                metrics[k] = vals[k] / w
        # the probes average over tokens that have engine log-probs
        counted = vals.pop("rollout_tokens")
        metrics["train_rollout_logprob_diff"] = vals["train_rollout_logprob_diff"] / counted if counted else 0.0
        metrics["train_rollout_logprob_diff_frac"] = (vals["train_rollout_logprob_diff_over"] / counted
                                                      if counted else 0.0)
        metrics.update({k: vals[k] for k in MAX_KEYS})
        metrics.update(tb.metrics)
        metrics["grad_norm"] = vals["grad_norm"]
        if actor.router_stats is not None:
            metrics.update(actor.router_stats.metrics())
        metrics["lr"] = actor.lr
        if actor.lora:
            metrics["lora/params"] = float(actor.adapter_params)  # (`rlx.train.lora`) what the optimizer trains
        metrics["samples"] = float(len(tb.samples))
        metrics["tokens"] = float(sum(s.total_len for s in tb.samples))
        return metrics
