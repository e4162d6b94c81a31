"""A core attention over torch's scaled_dot_product_attention for megatron's local layer specs, and the
block-causal mask of packed rows it takes without an [L, L] tensor.

Every model spec rlx builds uses `SDPACoreAttention` (`rlx.train.decoder.DecoderSpec.layer_spec`):

* megatron-core's local ``DotProductAttention`` materialises every score of a row ([heads, L, L] floats, then
  the softmax's copies): a 22k-token agent trajectory would need tens of GB. With a `BlockCausal` mask this
  attention runs each packed sample as its own causal block (``is_causal``, no mask tensor: torch's
  memory-efficient kernels), so memory grows with the tokens, and compute with the sum of each sample's
  length squared, not the row's.
* it does not accept ``k_channels``/``v_channels`` (still so in megatron-core 0.19), which multi-latent
  attention passes (its keys and values have different head sizes).

A plain tensor mask also works (megatron's convention: True where attention is not allowed).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from rlx.train.masks import BlockCausal, block_causal_attention

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


class SDPACoreAttention(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: object = None, **kwargs: Any):  # megatron's call; the groups are not used
        super().__init__(config=config)
        unsupported = {"window_size": getattr(config, "window_size", None) is not None,
                       "softmax_type": getattr(config, "softmax_type", "vanilla") != "vanilla",
                       "apply_query_key_layer_scaling": bool(getattr(config, "apply_query_key_layer_scaling", False)),
                       "context_parallel_size": getattr(config, "context_parallel_size", 1) > 1}
        if any(unsupported.values()):
            raise ValueError(f"SDPACoreAttention (rlx's core attention) does not implement the model config's "
                             f"{', '.join(k for k, on in unsupported.items() if on)}")
        self.attn_mask_type = attn_mask_type
        k = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: BlockCausal | torch.Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: object = None, **kwargs: Any) -> torch.Tensor:
        """query [sq, b, heads, dk], key [sk, b, groups, dk], value [sk, b, groups, dv] -> [sq, b, heads * dv]."""
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention takes packed rows through the attention mask, "
                             "not packed_seq_params")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.size(1) != q.size(1):  # grouped-query attention
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        if isinstance(attention_mask, BlockCausal):
            if attention_bias is not None:
                raise ValueError("SDPACoreAttention: an attention bias with a block-causal mask is not supported")
            out = block_causal_attention(q, k, v, attention_mask, self.softmax_scale, dropout)
            return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)
        mask, causal = None, False
        if attention_mask is not None:
            mask = ~attention_mask.bool()
        elif (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and q.size(2) > 1:
            causal = True
        if attention_bias is not None:
            bias = attention_bias.to(q.dtype)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout,
                                             scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)
