"""Packing samples into one row without padding, and reading per-token results back out.

A micro-batch is one sequence of concatenated samples. Attention is block-diagonal causal, so no
token sees another sample. Positions run on across samples: RoPE depends only on the distance
between query and key, and within a block those distances are the same as from 0 (the trainer's
logits match an unpacked forward pass to float rounding; see the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlx.types import Sample


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, S]
    position_ids: torch.Tensor  # [1, S]
    attention_mask: torch.Tensor  # [1, 1, S, S] bool, True where attention is NOT allowed (megatron)
    targets: torch.Tensor  # [S] the next token at each position (0 where none)
    response_positions: torch.Tensor  # [T] positions whose next token is a response token
    seq_index: torch.Tensor  # [T] which sample (0..n-1) each response token belongs to
    samples: list[Sample]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack(samples: list[Sample], pad_to_multiple: int = 1) -> PackedBatch:
    """One packed row from samples (prompt + response each); response tokens are what the loss sees."""
    ids: list[int] = []
    seg: list[int] = []
    targets: list[int] = []
    resp_pos: list[int] = []
    seq_index: list[int] = []
    for i, s in enumerate(samples):
        full = s.prompt_ids + s.response_ids
        start = len(ids)
        ids += full
        seg += [i] * len(full)
        targets += full[1:] + [0]
        # logits at position p predict token p + 1: response token j is predicted at prompt_len + j - 1
        first = start + len(s.prompt_ids) - 1
        resp_pos += range(first, first + len(s.response_ids))
        seq_index += [i] * len(s.response_ids)
    pad = (-len(ids)) % pad_to_multiple
    ids += [0] * pad
    seg += [-1 - k for k in range(pad)]  # each pad token alone in its own block
    targets += [0] * pad
    n = len(ids)
    seg_t = torch.tensor(seg)
    allowed = (seg_t[:, None] == seg_t[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    return PackedBatch(
        input_ids=torch.tensor([ids]),
        position_ids=torch.arange(n)[None],
        attention_mask=~allowed[None, None],
        targets=torch.tensor(targets),
        response_positions=torch.tensor(resp_pos, dtype=torch.long),
        seq_index=torch.tensor(seq_index, dtype=torch.long),
        samples=samples,
    )


def per_token(samples: list[Sample], values: dict[int, float] | dict[int, list[float]]) -> torch.Tensor:
    """A flat ``[T]`` tensor over the samples' response tokens from per-sample scalars or lists."""
    out: list[float] = []
    for s in samples:
        v = values[s.sample_id]
        out += v if isinstance(v, list) else [v] * len(s.response_ids)
    return torch.tensor(out, dtype=torch.float32)
