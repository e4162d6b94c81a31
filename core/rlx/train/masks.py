"""The attention mask of packed rows as block lengths (`BlockCausal`), and attention over it
(`block_causal_attention`): each block (sample) attends causally within itself, in batches of blocks of about
one length, so there is no [L, L] tensor, memory grows with the tokens and compute with each sample's length
squared rather than its row's. `rlx.train.attention.SDPACoreAttention` takes it inside megatron; torch only
here, so packing does not need megatron."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

@dataclass
class BlockCausal:
    """The attention mask of packed rows, by block lengths: row ``r`` holds consecutive samples of lengths
    ``blocks[r]`` from column 0; a token attends causally within its own sample. Columns past a row's samples
    (the padding up to `width`) each attend to themselves only. Passed where megatron takes ``attention_mask``."""

    blocks: list[list[int]]
    width: int

    def __post_init__(self):
        self._buckets: dict[Any, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for r, row in enumerate(self.blocks):
            if any(n <= 0 for n in row):
                raise ValueError(f"row {r}: blocks {row}: a sample of no tokens")
            if sum(row) > self.width:
                raise ValueError(f"row {r}: blocks {row} do not fit a row of {self.width}")
        self.has_padding = any(sum(row) < self.width for row in self.blocks)  # some row ends in padding columns

    def to(self, device: torch.device | str) -> BlockCausal:  # what the trainer does with a mask tensor
        return self

    def dense(self) -> torch.Tensor:
        """The same mask as megatron's tensor: ``[rows, 1, width, width]`` bool, True where not allowed."""
        seg = torch.full((len(self.blocks), self.width), -1, dtype=torch.long)
        for r, row in enumerate(self.blocks):
            col = 0
            for i, n in enumerate(row):
                seg[r, col:col + n] = i
                col += n
        pad = seg < 0
        seg[pad] = -2 - torch.arange(int(pad.sum()))  # each pad token alone in its own block
        causal = torch.ones(self.width, self.width, dtype=torch.bool).tril()
        return ~((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]

    def buckets(self, device: torch.device | str,
                ratio: float = 0.8) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The blocks in batches of about one length, for `block_causal_attention`; built once per device (every
        layer of a forward and its backward share them). Longest first, a batch takes blocks down to `ratio` of
        its longest (so its padded compute is at most 1/ratio^2 of its blocks' own). Per batch: ``gather``
        ``[blocks, longest]``, flat (row * width + column) positions, a block's padding repeating its last
        token; ``keep``, which of the batch's ``blocks * longest`` outputs are real; ``dest``, their positions."""
        if device not in self._buckets:
            spans = []  # (length, flat start)
            for r, row in enumerate(self.blocks):
                col = 0
                for n in row:
                    spans.append((n, r * self.width + col))
                    col += n
            spans.sort(key=lambda x: (-x[0], x[1]))
            out, i = [], 0
            while i < len(spans):
                longest = spans[i][0]
                j = i
                while j < len(spans) and spans[j][0] >= ratio * longest:
                    j += 1
                lens = torch.tensor([x[0] for x in spans[i:j]])
                start = torch.tensor([x[1] for x in spans[i:j]])
                offs = torch.arange(longest)
                real = offs[None, :] < lens[:, None]
                gather = start[:, None] + torch.minimum(offs[None, :], lens[:, None] - 1)
                keep = real.flatten().nonzero()[:, 0]
                out.append((gather.to(device), keep.to(device), gather.flatten()[keep].to(device)))
                i = j
            self._buckets[device] = out
        return self._buckets[device]


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockCausal, scale: float,
                           dropout_p: float = 0.0) -> torch.Tensor:
    """``[b, heads, s, d]`` attention of each block alone (causal); a padding column's output is its own value,
    as a token that sees only itself.

    Variable-length attention without a varlen kernel: the blocks (samples) are gathered out of their rows into
    batches of blocks of about one length (`BlockCausal.buckets`), each batch padded at its end to its longest
    block and run in one causal call (a block's queries never see the padding after it), and the outputs put
    back. Compute goes with each sample's length squared, not its row's, and the calls per layer with the number
    of distinct lengths, not of samples."""
    if q.size(0) != len(mask.blocks) or q.size(2) != mask.width:
        raise ValueError(f"block-causal attention: queries of {q.size(0)} rows x {q.size(2)} positions for a mask "
                         f"of {len(mask.blocks)} rows x {mask.width} (a split sequence is not supported)")
    b, h, s = q.shape[:3]
    dv = v.size(-1)
    flat = [t.transpose(1, 2).reshape(b * s, t.size(1), t.size(-1)) for t in (q, k, v)]  # [(row, col), heads, d]
    pieces, where = [], []
    for gather, keep, dest in mask.buckets(q.device):
        nb, longest = gather.shape
        qb, kb, vb = (t.index_select(0, gather.flatten()).view(nb, longest, h, -1).transpose(1, 2) for t in flat)
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=longest > 1, dropout_p=dropout_p, scale=scale)
        pieces.append(o.transpose(1, 2).reshape(-1, h, dv).index_select(0, keep))
        where.append(dest)
    res = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    dest = torch.cat(where) if len(where) > 1 else where[0]
    base = flat[2] if mask.has_padding else torch.zeros_like(flat[2])
    out = base.index_copy(0, dest, res)
    return out.reshape(b, s, h, dv).transpose(1, 2)
