"""`TrainBatch`: one step's trainable samples and their per-token values, between the RL step and the
objective. Per-token values are 1-D tensors over each sample's response tokens, keyed by sample id."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlx.types import Group, Sample


@dataclass
class TrainBatch:
    """One step's trainable samples and their per-token values, keyed by sample id.

    Per-token values are 1-D tensors over each sample's response tokens; `tokens` lays them out flat
    in the order of any list of samples (a packed micro-batch).
    """

    step: int
    groups: list[Group]
    samples: list[Sample]  # trainable, in training order
    advantages: dict[int, torch.Tensor]
    weights: dict[int, torch.Tensor]  # normalisation weight per token, 0 where the loss mask is 0
    returns: dict[int, torch.Tensor] | None = None  # value targets (methods with a critic)
    values: dict[int, torch.Tensor] | None = None  # the critic's estimates
    old_logprobs: dict[int, torch.Tensor] | None = None  # the trainer's, before this step's first update
    ref_logprobs: dict[int, torch.Tensor] | None = None  # the reference model's
    metrics: dict[str, float] = field(default_factory=dict)

    def tokens(self, samples: list[Sample], name: str) -> torch.Tensor:
        """Flat ``[T]`` tensor of a per-token value over `samples`' response tokens."""
        values = getattr(self, name)
        return torch.cat([values[s.sample_id] for s in samples]) if samples else torch.zeros(0)

    @staticmethod
    def rollout_logprobs(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's log-probs over `samples`' response tokens, and 1 where they exist (0 for samples
        whose engine reported none)."""
        values, has = [], []
        for s in samples:
            n = len(s.response_ids)
            values += s.rollout_logprobs if s.rollout_logprobs is not None else [0.0] * n
            has += [1.0 if s.rollout_logprobs is not None else 0.0] * n
        return torch.tensor(values, dtype=torch.float32), torch.tensor(has, dtype=torch.float32)

    @staticmethod
    def loss_mask(samples: list[Sample]) -> torch.Tensor:
        return torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float32)
