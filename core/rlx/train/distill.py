"""On-policy distillation's objective (``train.objective.distill``): the reverse KL from the student to the teacher
that scored its samples (`rlx.rollout.teachers`), on the model's tokens only (the loss mask).

* ``token`` (slime's OPD, Thinking Machines' on-policy distillation): each token's advantage gets
  ``-coef * (log q(y_t) - log p_teacher(y_t))``, with q the distribution the token was sampled from (the engine's
  log-prob): the sampled-token estimate of KL(q || p_teacher) as a per-token reward, beside the task's advantage.
* ``top_k``: a loss term, ``coef`` times the KL from the student's distribution (temperature 1) to the teacher's
  over the teacher's top-k tokens and one bucket for all others, differentiable in the student's logits: with k the
  whole vocabulary it is the exact reverse KL, below it a lower bound (the buckets merge tokens).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from rlx.train.batch import TrainBatch
from rlx.types import Sample

TAIL_FLOOR = 1e-8  # the probability of an empty bucket, so that its log is finite


def distill_advantages(tb: TrainBatch, coef: float) -> None:
    """The token estimator: every distilled sample's advantages minus `coef` times the sampler's log-prob minus the
    teacher's, on its model-sampled tokens (samples without the sampler's log-probs are left as they are)."""
    for s in tb.samples:
        if s.teacher is None or s.rollout_logprobs is None:
            continue
        kl = torch.tensor(s.rollout_logprobs) - torch.tensor(s.teacher.logprobs)
        tb.advantages[s.sample_id] = tb.advantages[s.sample_id] - coef * kl * torch.tensor(s.loss_mask,
                                                                                            dtype=torch.float32)


def teacher_top(samples: list[Sample], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teachers' top-k ids and log-probs over `samples`' response tokens (``[T, k]`` each), and 1 where a
    teacher scored the token (samples it did not score get ids 0 and log-probs of a uniform k, weighted 0)."""
    # a vocabulary smaller than k: the teacher gave every id
    k = min(k, next((len(s.teacher.top_ids[0]) for s in samples if s.teacher is not None and s.teacher.top_ids), k))
    ids, lps, has = [], [], []
    for s in samples:
        n = len(s.response_ids)
        t = s.teacher
        if t is None or len(t.top_ids) != n:
            ids += [[0] * k] * n
            lps += [[-math.log(k)] * k] * n
            has += [0.0] * n
            continue
        ids += [row[:k] for row in t.top_ids]
        lps += [row[:k] for row in t.top_logprobs]
        has += [1.0] * n
    return (torch.tensor(ids, dtype=torch.long).reshape(-1, k), torch.tensor(lps, dtype=torch.float32).reshape(-1, k),
            torch.tensor(has, dtype=torch.float32))


def vocab_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)`` at `ids` (``[T, k]`` of vocabulary ids), with grad; with the vocabulary split over
    tensor-parallel ranks (`logits` ``[T, V/tp]``, this rank's slice), each rank contributes the ids it holds."""
    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return torch.log_softmax(logits, -1).gather(-1, ids)
    width = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    m = logits.detach().max(-1, keepdim=True).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = reduce_from_tensor_model_parallel_region(torch.exp(logits - m).sum(-1, keepdim=True))
    here = (ids >= start) & (ids < start + width)
    picked = reduce_from_tensor_model_parallel_region(logits.gather(-1, (ids - start).clamp(0, width - 1)) * here)
    return picked - m - torch.log(z)


def topk_reverse_kl(student: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per token, KL(student || teacher) over the buckets {each of the k tokens} and {every other token}, from both
    models' log-probs of the k tokens (``[T, k]``); the rest's probability is what the k leave (floored at
    `TAIL_FLOOR`). `valid` (``[T, k]`` bool): the ids that count (the others' teacher mass goes to the rest)."""
    s, t = student.exp(), teacher.exp()
    term = s * (student - teacher)
    if valid is not None:
        s, t, term = s * valid, t * valid, torch.where(valid, term, torch.zeros_like(term))
    s_rest = (1 - s.sum(-1)).clamp_min(TAIL_FLOOR)
    t_rest = (1 - t.sum(-1)).clamp_min(TAIL_FLOOR)
    return term.sum(-1) + s_rest * (s_rest.log() - t_rest.log())
