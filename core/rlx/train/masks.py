"""The attention mask of packed rows as block lengths (`BlockCausal`), and attention over it
(`block_causal_attention`): rows longer than `DENSE_WIDTH` run each block alone (no [L, L] tensor, memory that
grows with the tokens, compute with each sample's length squared rather than the row's); shorter rows run in one
call under a dense mask built once per micro-batch (many short samples would otherwise cost a call each, per
layer). `rlx.train.attention.SDPACoreAttention` takes it inside megatron; torch only here, so packing does not
need megatron."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

DENSE_WIDTH = 2048  # rows up to this long attend in one call under a dense mask (2048^2 booleans: 4 MiB a row)


@dataclass
class BlockCausal:
    """The attention mask of packed rows, by block lengths: row ``r`` holds consecutive samples of lengths
    ``blocks[r]`` from column 0; a token attends causally within its own sample. Columns past a row's samples
    (the padding up to `width`) each attend to themselves only. Passed where megatron takes ``attention_mask``."""

    blocks: list[list[int]]
    width: int

    def __post_init__(self):
        self._allowed: dict[Any, torch.Tensor] = {}  # device -> the dense "allowed" mask, built once
        for r, row in enumerate(self.blocks):
            if any(n <= 0 for n in row):
                raise ValueError(f"row {r}: blocks {row}: a sample of no tokens")
            if sum(row) > self.width:
                raise ValueError(f"row {r}: blocks {row} do not fit a row of {self.width}")

    def to(self, device: Any) -> BlockCausal:  # what the trainer does with a mask tensor
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

    def allowed(self, device: Any) -> torch.Tensor:
        """``~dense()`` on `device`, built once (every layer of a forward and its backward share it)."""
        if device not in self._allowed:
            self._allowed[device] = (~self.dense()).to(device)
        return self._allowed[device]


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockCausal, scale: float,
                           dropout_p: float = 0.0, dense_width: int = DENSE_WIDTH) -> torch.Tensor:
    """``[b, heads, s, d]`` attention of each block alone (causal); a padding column's output is its own value,
    as a token that sees only itself. Rows of at most `dense_width` columns: one call under the dense mask."""
    if q.size(0) != len(mask.blocks) or q.size(2) != mask.width:
        raise ValueError(f"block-causal attention: queries of {q.size(0)} rows x {q.size(2)} positions for a mask "
                         f"of {len(mask.blocks)} rows x {mask.width} (a split sequence is not supported)")
    if mask.width <= dense_width:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.allowed(q.device), dropout_p=dropout_p,
                                              scale=scale)
    rows = []
    for r, row in enumerate(mask.blocks):
        parts, col = [], 0
        for n in row:
            sl = slice(col, col + n)
            parts.append(F.scaled_dot_product_attention(q[r:r + 1, :, sl], k[r:r + 1, :, sl], v[r:r + 1, :, sl],
                                                        is_causal=n > 1, dropout_p=dropout_p, scale=scale))
            col += n
        if col < q.size(2):
            parts.append(v[r:r + 1, :, col:])
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
