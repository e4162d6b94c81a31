"""The training objective of one micro-batch: log-probs from the logits, then policy loss, KL penalty,
entropy bonus and truncated importance sampling, each weighted per token so that micro-batches add up
to the global loss. `micro_loss` is what megatron's schedule calls on the last pipeline stage."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from rlx.protocols import LossInputs as LossInputs  # re-exported: defined beside its contract
from rlx.train.batch import TrainBatch
from rlx.train.distill import teacher_top, topk_reverse_kl, vocab_logprobs
from rlx.train.losses import importance_ratio, kl_penalty, tis_weights

if TYPE_CHECKING:
    from rlx.config import ObjectiveConfig
    from rlx.protocols import PolicyLoss
    from rlx.train.packing import PackedBatch


#: Metrics reduced with a maximum over micro-batches and ranks (the others are sums).
MAX_KEYS = ("train_rollout_logprob_diff_max",)


def metric_keys(kl: bool, entropy: bool, mtp: bool = False, distill_top_k: bool = False) -> list[str]:
    """The metrics `micro_loss` returns, given whether reference log-probs and entropy are passed in, whether
    multi-token-prediction layers train and whether the top-k distillation term is in the loss."""
    return (["pg_loss", "clip_frac", "tis_weight", "tis_masked", "train_rollout_logprob_diff",
             "train_rollout_logprob_diff_over", "train_rollout_logprob_diff_max", "rollout_tokens", "weight", "loss"]
            + (["kl"] if kl else []) + (["entropy"] if entropy else []) + (["mtp_loss"] if mtp else [])
            + (["distill_topk_kl"] if distill_top_k else []))


def objective(inp: LossInputs, policy_loss: PolicyLoss, cfg: ObjectiveConfig,
              diff_threshold: float = 0.5) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss to back-propagate and metric sums: weighted by the normalisation weights (divide by their sum
    to average), except the trainer-vs-engine log-prob probes, which count tokens with engine log-probs
    (``rollout_tokens``; their largest difference is ``train_rollout_logprob_diff_max``).

    `cfg` is the ``train.objective`` section. Tokens without engine log-probs get no importance correction.
    """
    w = inp.weights
    has = inp.has_rollout if inp.has_rollout is not None else torch.ones_like(w)
    per_token, clipped = policy_loss.loss(inp)
    tis = torch.ones_like(per_token)
    if cfg.tis_cap is not None:
        ratio = importance_ratio(inp.old_logprobs, inp.rollout_logprobs, has, cfg.tis_level, inp.seq_index,
                                 inp.mask)
        tis = torch.where(has > 0, tis_weights(ratio, cfg.tis_cap, cfg.tis_mode, cfg.tis_low), tis)
        per_token = per_token * tis
    pg = (per_token * w).sum()
    loss = pg
    counted = inp.mask * has
    diff = (inp.old_logprobs - inp.rollout_logprobs).detach().abs() * counted
    metrics = {
        "pg_loss": float(pg.detach()),
        "clip_frac": float((clipped.float() * w).sum()),
        "tis_weight": float((tis * w).sum()),
        "tis_masked": float(((tis == 0).float() * w).sum()),
        "train_rollout_logprob_diff": float(diff.sum()),
        "train_rollout_logprob_diff_over": float(((diff > diff_threshold).float() * counted).sum()),
        "train_rollout_logprob_diff_max": float(diff.max()) if diff.numel() else 0.0,
        "rollout_tokens": float(counted.sum()),
        "weight": float(w.sum()),
    }
    if inp.ref_logprobs is not None:
        kl = (kl_penalty(inp.logprobs, inp.ref_logprobs, cfg.kl_type, inp.old_logprobs) * w).sum()
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


def micro_loss(mb: PackedBatch, logits: torch.Tensor, *, tb: TrainBatch, policy_loss: PolicyLoss,
               cfg: ObjectiveConfig, diff_threshold: float = 0.5,
               scale: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one packed micro-batch from its logits, with the batch's per-token values; `scale`
    multiplies the normalisation weights (so that one update's mini-batch sums to one)."""
    dev = logits.device
    top_k = cfg.distill is not None and cfg.distill.estimator == "top_k"
    resp = mb.at_response(logits).float() if top_k else None  # [T, V/tp], read twice
    logprobs, ent = response_logprobs(mb, logits, entropy=True, entropy_grad=bool(cfg.entropy_coef),
                                      resp_logits=resp)
    s = mb.samples
    rollout, has = TrainBatch.rollout_logprobs(s)
    inp = LossInputs(
        logprobs=logprobs,
        old_logprobs=(tb.tokens(s, "old_logprobs").to(dev) if tb.old_logprobs is not None
                      else logprobs.detach()),
        rollout_logprobs=rollout.to(dev),
        has_rollout=has.to(dev),
        advantages=tb.tokens(s, "advantages").to(dev),
        weights=tb.tokens(s, "weights").to(dev) * scale,
        mask=TrainBatch.loss_mask(s).to(dev),
        seq_index=mb.seq_index.to(dev),
        ref_logprobs=tb.tokens(s, "ref_logprobs").to(dev) if tb.ref_logprobs is not None else None,
        entropy=ent if cfg.entropy_coef else ent.detach(),
    )
    loss, metrics = objective(inp, policy_loss, cfg, diff_threshold)
    if mb.mtp_logprobs is not None:  # (`rlx.train.mtp`): the tokens weighted as the policy's, averaged over depths
        mtp = -(mb.mtp_logprobs * inp.weights).sum() / mb.mtp_logprobs.shape[0]
        metrics["mtp_loss"] = float(mtp.detach())
        loss = loss + cfg.mtp_loss_coef * mtp
    if top_k and cfg.distill is not None and resp is not None:  # (`rlx.train.distill`)
        ids, teacher, scored = teacher_top(s, cfg.distill.top_k)
        ids = ids.to(dev)
        width = resp.shape[-1] * (ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized()
                                  else 1)
        ours = ids < width  # a teacher with a larger (padded) vocabulary may name ids the student has not
        student = vocab_logprobs(resp, ids.clamp(max=width - 1))
        kl = (topk_reverse_kl(student, teacher.to(dev), ours) * inp.weights * scored.to(dev)).sum()
        metrics["distill_topk_kl"] = float(kl.detach())
        loss = loss + cfg.distill.coef * kl
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def response_logprobs(mb: PackedBatch, logits: torch.Tensor, entropy: bool, entropy_grad: bool = False,
                      resp_logits: torch.Tensor | None = None):
    """Log-probs of the response tokens (and their entropy) from the last stage's logits, vocab-parallel
    safe, of the distribution each token was sampled from: the logits over its sampling temperature.

    The entropy is computed without a graph unless `entropy_grad` (it is a loss term, not only a metric). With the
    vocabulary on one rank, one log-softmax gives both (the [T, V] passes are most of the loss's time on a
    large vocabulary: 49k entries x 470 tokens is 92 MB a pass); split over TP ranks, megatron's cross
    entropy and `vocab_parallel_entropy` reduce across them. `resp_logits`: the caller's fp32 logits at the response
    positions, when it has them already (the top-k distillation term reads them too)."""
    dev = logits.device
    pos = mb.response_positions.to(dev)
    if resp_logits is None:
        resp_logits = mb.at_response(logits).float()  # [T, V/tp]
    if not bool((mb.temperatures == 1.0).all()):
        resp_logits = resp_logits / mb.temperatures.to(dev)[:, None]
    targets = mb.targets.to(dev)[pos]
    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        logp = torch.log_softmax(resp_logits, dim=-1)
        logprobs = logp.gather(-1, targets[:, None])[:, 0]
        ent = None
        if entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = -(logp.exp() * logp).sum(-1)
        return logprobs, ent
    ent = None
    if entropy:  # first: megatron's cross entropy turns its input into probabilities in place
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = vocab_parallel_entropy(resp_logits)
    logprobs = -tensor_parallel.vocab_parallel_cross_entropy(resp_logits[:, None, :].clone(), targets[:, None])[:, 0]
    return logprobs, ent


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the full vocabulary when its last dim is split over TP ranks."""
    tp = ps.get_tensor_model_parallel_world_size()
    m = logits.detach().max(-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(logits - m)
    z = e.sum(-1)
    s = (e * logits).sum(-1)
    if tp > 1:
        z = reduce_from_tensor_model_parallel_region(z)
        s = reduce_from_tensor_model_parallel_region(s)
    return torch.log(z) + m[:, 0] - s / z
