"""MiniMax-M2's q and k norms on megatron: RMSNorm over all of a token's query (key) heads together."""

from __future__ import annotations

from typing import Any

import torch


class FullWidthRMSNorm(torch.nn.Module):
    """RMSNorm over a token's heads together (``[s, b, heads, head_dim]``, normalised over the last two), for
    megatron's ``q_layernorm``/``k_layernorm`` slots. Tensor parallelism splits the heads and the weight with them;
    each rank's sum of squares is all-reduced over the group, in the backward pass too (each rank's outputs depend on
    every rank's inputs). As transformers' ``MiniMaxM2RMSNorm``: fp32 statistics, the weight applied in the input's
    dtype."""

    heads_of: str  # the config attribute with the global number of heads

    def __init__(self, hidden_size: int, config: Any, eps: float = 1e-6):
        super().__init__()
        self.tp = config.tensor_model_parallel_size
        heads = getattr(config, self.heads_of)
        self.width = heads * hidden_size  # every head's dimensions, over all ranks
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(self.width // self.tp, dtype=config.params_dtype))
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)  # one rank's heads (grad norm, checkpoints)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        flat = x.reshape(*shape[:-2], -1).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            from megatron.core import parallel_state as ps
            from torch.distributed.nn.functional import all_reduce

            squares = all_reduce(squares, group=ps.get_tensor_model_parallel_group())
        normed = flat * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * normed.to(dtype)).reshape(shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets)


class FullWidthQNorm(FullWidthRMSNorm):
    heads_of = "num_attention_heads"


class FullWidthKNorm(FullWidthRMSNorm):
    heads_of = "num_query_groups"
