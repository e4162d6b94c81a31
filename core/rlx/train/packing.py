"""Packing samples into micro-batches and rows without padding, and reading per-token results back out.

Micro-batches: first-fit decreasing into bins of at most ``max_tokens`` tokens (`micro_batches`); a single
sample longer than the bound gets a bin of its own. The same bins cut a micro-batch into rows.

A micro-batch is one sequence of concatenated samples. Attention is block-diagonal causal, so no
token sees another sample: the mask is the samples' lengths per row (`rlx.train.masks.BlockCausal`), never
an [L, L] tensor. Each sample's positions start at 0, as in the engine (`PackedBatch.position_ids`; the
trainer rotates queries and keys by them, `rlx.train.model.ModelRole`), so a sample packed anywhere in
a row gets the logits it gets alone.

By default a micro-batch is one row (``train.row_tokens: null``): with attention per sample nothing grows
with a row's length, and a single row has no padding. Shorter rows (``row_tokens``) are padded to the
longest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlx.train.masks import BlockCausal
from rlx.types import Sample


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [R, L]: R rows of packed samples, padded to the longest row
    position_ids: torch.Tensor  # [R, L]: each token's place in its own sample (0 at padding)
    attention_mask: BlockCausal  # each sample attends causally within itself (`.dense()`: megatron's tensor)
    targets: torch.Tensor  # [R * L] the next token at each position (0 where none)
    response_positions: torch.Tensor  # [T] flat positions (row * L + col) predicting a response token
    seq_index: torch.Tensor  # [T] which sample (0..n-1, in `samples` order) each response token is from
    temperatures: torch.Tensor  # [T] the sampling temperature of each response token's distribution
    samples: list[Sample]  # in packed order
    starts: list[tuple[int, int]] = field(default_factory=list)  # per sample (packed order): its row, first column
    pad_mask: torch.Tensor | None = None  # [R, L] True where no sample sits (megatron's MoE padding mask)
    # set by the trainer: the model's outputs are [1, T, ...] at `response_positions` only, not [R, L, ...]
    outputs_at_response: bool = False
    # set by the trainer in a training forward with multi-token-prediction layers (`rlx.train.mtp`): [depths, T]
    mtp_logprobs: torch.Tensor | None = None

    def at_response(self, out: torch.Tensor) -> torch.Tensor:
        """The model's per-position outputs (logits or values) at the response positions: ``[T, last dim]``."""
        flat = out.reshape(-1, out.shape[-1])
        return flat if self.outputs_at_response else flat[self.response_positions.to(out.device)]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def pack(samples: list[Sample], row_tokens: int | None = None) -> PackedBatch:
    """Samples (prompt + response each) packed into rows of at most `row_tokens` tokens.

    One row holds everything when `row_tokens` is None; otherwise `balanced_rows` (a sample longer than
    `row_tokens` gets a row of its own; every row is padded to the longest).
    """
    lengths = [s.total_len for s in samples]
    rows = [list(range(len(samples)))] if row_tokens is None else balanced_rows(lengths, row_tokens)
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    pad = torch.ones(len(rows), width, dtype=torch.bool)
    targets = torch.zeros(len(rows), width, dtype=torch.long)
    resp_pos: list[int] = []
    seq_index: list[int] = []
    temps: list[float] = []
    ordered: list[Sample] = []
    starts: list[tuple[int, int]] = []
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            s = samples[i]
            full = s.prompt_ids + s.response_ids
            ids[r, col:col + len(full)] = torch.tensor(full)
            positions[r, col:col + len(full)] = torch.arange(len(full))
            pad[r, col:col + len(full)] = False
            targets[r, col:col + len(full) - 1] = torch.tensor(full[1:], dtype=torch.long)
            # logits at position p predict token p + 1: response token j is predicted at prompt_len + j - 1
            first = r * width + col + len(s.prompt_ids) - 1
            resp_pos += range(first, first + len(s.response_ids))
            seq_index += [len(ordered)] * len(s.response_ids)
            temps += s.token_temperatures + [1.0] * (len(s.response_ids) - len(s.token_temperatures))
            ordered.append(s)
            starts.append((r, col))
            col += len(full)
    blocks = [[lengths[i] for i in row] for row in rows]
    return PackedBatch(
        input_ids=ids,
        position_ids=positions,
        attention_mask=BlockCausal(blocks, width),
        targets=targets.flatten(),
        response_positions=torch.tensor(resp_pos, dtype=torch.long),
        seq_index=torch.tensor(seq_index, dtype=torch.long),
        temperatures=torch.tensor(temps, dtype=torch.float32),
        samples=ordered,
        starts=starts,
        pad_mask=pad,
    )


def per_token(samples: list[Sample], values: dict[int, float] | dict[int, list[float]]) -> torch.Tensor:
    """A flat ``[T]`` tensor over the samples' response tokens from per-sample scalars or lists."""
    out: list[float] = []
    for s in samples:
        v = values[s.sample_id]
        out += v if isinstance(v, list) else [v] * len(s.response_ids)
    return torch.tensor(out, dtype=torch.float32)


def balanced_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Sample indices into rows of at most `row_tokens` tokens, as even as they can be made: every row is padded
    to the longest, and the padding costs the whole model's FLOPs. As many rows as first-fit decreasing needs,
    then the samples dealt longest first to the row with the fewest tokens; first-fit's own rows where that
    puts more than `row_tokens` tokens in a row of several samples, or pads more. (16 samples of 50-78 tokens
    in rows of 256, 951 tokens: first-fit's 4 rows are padded to 1,024 positions, dealt ones to 956.)"""
    first_fit = micro_batches(lengths, row_tokens)
    if len(first_fit) <= 1:
        return first_fit
    rows: list[list[int]] = [[] for _ in first_fit]
    used = [0] * len(rows)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(len(rows)), key=lambda r: (used[r], r))
        rows[r].append(i)
        used[r] += lengths[i]

    def padded(rs: list[list[int]]) -> int:
        return len(rs) * max(sum(lengths[i] for i in row) for row in rs)

    overfull = any(len(row) > 1 and n > row_tokens for row, n in zip(rows, used, strict=True))
    if overfull or padded(rows) > padded(first_fit):
        return first_fit
    return [sorted(row) for row in rows]


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing of sample indices into bins of at most `max_tokens` tokens."""
    bins: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, (used, items) in enumerate(bins):
            if used + lengths[i] <= max_tokens:
                bins[b] = (used + lengths[i], items + [i])
                break
        else:
            bins.append((lengths[i], [i]))
    return [sorted(items) for _, items in bins]
