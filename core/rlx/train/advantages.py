"""Advantage estimators and loss normalisation: per-sample numbers computed once for the global batch.

Choices:

* Advantages are per sample here (broadcast over its tokens by the RL step); an estimator may also give
  one per response token.
* An agent's branches (subagents, context compaction) are several samples with one ``trajectory_id``:
  they share its reward and count once in group statistics and in sequence/group normalisation.
* Normalisation is a per-token weight computed once for the whole global batch (`token_weights`), so a
  micro-batch's loss is ``sum(weight * per_token_loss)`` and micro-batches and data-parallel ranks add
  up to exactly the global loss, whatever the batch size: ``token`` (every response token counts
  equally), ``sequence`` (every sample equally) or ``group`` (every prompt equally, its samples sharing
  its weight; a prompt that yielded many samples does not outweigh one that yielded few).
"""

from __future__ import annotations

import math
from typing import Literal

from rlx.types import Group, Sample

Norm = Literal["token", "sequence", "group"]


def trajectories(samples: list[Sample]) -> dict[int, list[Sample]]:
    """Samples by trajectory: an agent's branches (subagents, context compaction) are several samples
    with one ``trajectory_id``, sharing its reward; any other sample is a trajectory of its own."""
    out: dict[int, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.trajectory_id if s.trajectory_id is not None else s.sample_id, []).append(s)
    return out


def grpo_advantages(groups: list[Group], normalize_std: bool = True, eps: float = 1e-6) -> dict[int, float]:
    """``(r - mean_group) / (std_group + eps)``, or without the std when `normalize_std` is off.

    Statistics are over the group's trajectories, each counted once however many samples it branched
    into; every sample of a trajectory gets its advantage. The std is the population std (a group of
    identical rewards gets 0). Returns sample_id -> advantage for the trainable samples.
    """
    out: dict[int, float] = {}
    for g in groups:
        trajs = trajectories([s for s in g.trainable if s.reward is not None])
        if not trajs:
            continue
        rewards = {i: ss[0].reward for i, ss in trajs.items()}
        mean = sum(rewards.values()) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards.values()) / len(rewards))
        for i, ss in trajs.items():
            adv = (rewards[i] - mean) / (std + eps) if normalize_std else rewards[i] - mean
            for s in ss:
                out[s.sample_id] = adv
    return out


def reinforce_pp_advantages(groups: list[Group], eps: float = 1e-6) -> dict[int, float]:
    """REINFORCE++ with a baseline: subtract the group mean, then whiten over the whole batch."""
    centred = grpo_advantages(groups, normalize_std=False)
    if not centred:
        return centred
    vals = list(centred.values())
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    return {k: (v - mean) / (std + eps) for k, v in centred.items()}


# -- normalisation -------------------------------------------------------------------------------


def token_weights(groups: list[Group], norm: Norm) -> dict[int, float]:
    """The weight of each loss-masked token of each trainable sample (sample_id -> weight per token).

    ``sequence`` and ``group`` count a trajectory once: the samples it branched into share its weight
    by their tokens, as if they were one sequence.
    """
    if norm == "token":
        total = sum(max(sum(s.loss_mask), 1) for g in groups for s in g.trainable)
        return {s.sample_id: 1.0 / total for g in groups for s in g.trainable}
    if norm not in ("sequence", "group"):
        raise ValueError(f"unknown loss normalisation {norm!r}")
    live = [(g, trajectories(g.trainable)) for g in groups if g.trainable]
    n_trajs = sum(len(t) for _, t in live)
    w: dict[int, float] = {}
    for _, trajs in live:
        for ss in trajs.values():
            tokens = max(sum(sum(s.loss_mask) for s in ss), 1)
            share = 1.0 / n_trajs if norm == "sequence" else 1.0 / (len(live) * len(trajs))
            for s in ss:
                w[s.sample_id] = share / tokens
    return w
