"""Gated delta net (GDN) layers on megatron's tensor-parallel linears, for packed rows (Qwen3-Next, Qwen3.5).

megatron-core 0.16.1 has a GDN module, but it imports flash-linear-attention at construction (which cannot run on
a CPU) and refuses packed sequences. `GatedDeltaNet` here is the same layer in megatron's terms (it sits where a
``TransformerLayer`` takes its ``self_attention``, between the input norm and the MLP), with:

* the mask of packed rows (`rlx.train.masks.BlockCausal`) turned into sequence offsets, so the causal convolution
  and the recurrence start afresh at each sample (a state carried from one sample into the next would make a
  packed row differ from each sample alone);
* the gated delta rule from the kernels hook (``gdn``: FlashQLA, fla or torch, `rlx.train.kernel_choice.select`),
  chosen once per device and dtype through the `kernel` callable the model spec gives it.

Parameters (local names; the bridge maps HF's): ``in_proj.weight`` (column parallel; each tensor-parallel rank's
rows are ``[q | k | v | z | b | a]`` of its own heads), ``conv1d.weight`` ``[channels, 1, width]`` over that
rank's ``[q | k | v]`` channels, ``dt_bias`` and ``A_log`` per value head, ``out_norm.weight`` (a plain RMSNorm
over each value head, gated by ``silu(z)``; every rank holds all of it and applies it to its own heads, so its
gradient is summed over tensor-parallel ranks), ``out_proj.weight`` (row parallel).

Per token, with r = value heads per key head: q, k (key heads) and v, z (value heads) come from the projection
and the causal convolution (q, k, v; SiLU after it); ``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)``; the rule runs with q and k L2-normalised, scale ``head_dim ** -0.5``; the output is
``rmsnorm(o) * weight * silu(z)``, then ``out_proj``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from rlx.train.masks import BlockCausal

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


def sequence_offsets(mask: BlockCausal | torch.Tensor | None, rows: int, width: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, starts)`` of the ``rows * width`` tokens of a micro-batch laid end to end (row by row):
    each packed sample is a sequence, and so is each row's padding after its samples (which nothing reads).
    `starts` holds, per token, the index of its sequence's first token. `mask`: a `BlockCausal`, None (each row
    one sequence) or megatron's dense block-causal tensor."""
    if mask is None:
        lengths = [[width]] * rows
    elif isinstance(mask, BlockCausal):
        if len(mask.blocks) != rows or mask.width != width:
            raise ValueError(f"GDN layer: a mask of {len(mask.blocks)} rows x {mask.width} for {rows} x {width} "
                             f"tokens (a split sequence is not supported)")
        lengths = [row + ([width - sum(row)] if sum(row) < width else []) for row in mask.blocks]
    else:  # megatron's dense mask [rows, 1, width, width], True where not allowed: a sample starts where a token
        #    cannot see the one before it
        allowed = ~mask.reshape(rows, width, width).bool()
        first = allowed.int().argmax(-1).cpu()  # per token, the first column it sees
        begins_at = first == torch.arange(width)
        lengths = []
        for r in range(rows):
            begins = begins_at[r].nonzero().flatten().tolist() or [0]
            lengths.append([b - a for a, b in zip(begins, begins[1:] + [width])])
    flat = torch.tensor([n for row in lengths for n in row], dtype=torch.long)
    cu = torch.cat([flat.new_zeros(1), flat.cumsum(0)])
    starts = torch.repeat_interleave(cu[:-1], flat)
    return cu.to(device), starts.to(device)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution of ``x [T, C]`` with ``weight [C, width]`` (the last tap on the token itself),
    where no token sees one before its sequence's start (`starts`)."""
    t, width = x.shape[0], weight.shape[1]
    xf, wf = x.float(), weight.float()  # summed in fp32, as a convolution accumulates
    out = xf * wf[:, width - 1]
    pos = torch.arange(t, device=x.device)
    for back in range(1, width):
        seen = (pos - back >= starts).float()[:, None]
        out = out + F.pad(xf, (0, 0, back, 0))[:t] * seen * wf[:, width - 1 - back]
    return out.to(x.dtype)


class _Weight(torch.nn.Module):
    """A module holding one parameter, ``weight``: the checkpoint's ``conv1d.weight`` and ``out_norm.weight``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


class GatedDeltaNet(MegatronModule):
    """A GDN layer in megatron's ``self_attention`` slot (``[s, b, h]`` in, ``(out, bias)`` out). `kernel` maps
    ``(device=, dtype=)`` to the gated delta rule to call (`rlx.train.kernel_choice.select` behind it)."""

    def __init__(self, config: TransformerConfig, layer_number: int | None = None, pg_collection: object = None,
                 kernel: Callable[..., Any] | None = None, hf_in_proj: tuple[str, ...] = (), **kwargs: Any):
        """`hf_in_proj`: the transformers modules ``in_proj`` holds, in peft's names (LoRA targets them together)."""
        super().__init__(config=config)
        if kernel is None:
            raise ValueError("GatedDeltaNet needs the kernel chooser of its model spec (kernel=...)")
        self.kernel_for = kernel
        self.hf_in_proj = hf_in_proj
        self._kernels: dict[Any, Callable[..., Any]] = {}
        tp = getattr(pg_collection, "tp", None)
        self.tp = tp.size() if tp is not None else tensor_parallel.get_tensor_model_parallel_world_size()
        c = config
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.nk, self.nv = c.linear_num_key_heads, c.linear_num_value_heads
        if self.nk % self.tp or self.nv % self.nk:
            raise ValueError(f"GDN layer: {self.nk} key heads must divide by tensor parallelism {self.tp}, and "
                             f"{self.nv} value heads by the key heads")
        self.nk_local, self.nv_local = self.nk // self.tp, self.nv // self.tp
        in_dim = 2 * self.nk * self.dk + 2 * self.nv * self.dv + 2 * self.nv
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            c.hidden_size, in_dim, config=c, init_method=c.init_method, bias=False, gather_output=False,
            skip_bias_add=True)
        channels = (2 * self.nk * self.dk + self.nv * self.dv) // self.tp
        self.conv1d = _Weight(torch.empty(channels, 1, c.linear_conv_kernel_dim, dtype=c.params_dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.nv_local, dtype=c.params_dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.nv_local, dtype=c.params_dtype).uniform_(1, 16).log())
        self.out_norm = _Weight(torch.ones(self.dv, dtype=c.params_dtype))
        self.eps = c.layernorm_epsilon
        self.out_proj = tensor_parallel.RowParallelLinear(
            self.nv * self.dv, c.hidden_size, config=c, init_method=c.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True)
        torch.nn.init.uniform_(self.conv1d.weight, -0.5, 0.5)
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):
            tensor_parallel.set_tensor_model_parallel_attributes(p, True, 0, 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """In checkpoints, each of in_proj's q, k, v, z, beta and a rows (and conv1d's q, k, v channels, and the rows of
        LoRA's ``B`` factors on in_proj, `rlx.train.lora`) is a tensor of its own, split over tensor-parallel ranks by
        heads, as are dt_bias and A_log: a rank's rows side by side would interleave by rank in one tensor, and load
        only under the tensor parallelism that wrote them."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        proj = sd[f"{prefix}in_proj.weight"]
        axis = len(sharded_offsets)  # (pipeline parallelism prepends the layer's own)
        tp_rank = proj.global_offset[axis] // proj.local_shape[0]
        qk, v, n = self.nk_local * self.dk, self.nv_local * self.dv, self.nv_local
        rows = {"q": qk, "k": qk, "v": v, "z": v, "b": n, "a": n}
        lora = [(k.removeprefix(prefix), rows) for k in sd if k.startswith(f"{prefix}in_proj.lora_B")]
        for name, parts in (("in_proj.weight", rows), ("conv1d.weight", {"q": qk, "k": qk, "v": v}), *lora):
            key = f"{prefix}{name}"

            def build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any,
                      parts: dict[str, int] = parts) -> list[ShardedTensor]:
                return [ShardedTensor.from_rank_offsets(f"{key}.{part}", piece, *sharded_offsets,
                                                        (axis, tp_rank, self.tp), replica_id=replica_id,
                                                        prepend_axis_num=axis)
                        for part, piece in zip(parts, t.split(list(parts.values())), strict=True)]

            sd[key] = ShardedTensorFactory(key, sd[key].data, build, torch.cat, proj.replica_id)
        for name in ("dt_bias", "A_log"):
            sd[f"{prefix}{name}"] = make_tp_sharded_tensor_for_checkpoint(getattr(self, name), f"{prefix}{name}", 0,
                                                                          prepend_offsets=sharded_offsets)
        return sd

    def _kernel(self, x: torch.Tensor) -> Any:
        key = (x.device, x.dtype)
        if key not in self._kernels:
            self._kernels[key] = self.kernel_for(device=x.device, dtype=x.dtype, head_dim=self.dk)
        return self._kernels[key]

    def forward(self, hidden_states: torch.Tensor, attention_mask: BlockCausal | torch.Tensor | None = None,
                inference_context: object = None, packed_seq_params: object = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:  # megatron's attention call (the last two: refused)
        if inference_context is not None or packed_seq_params is not None:
            raise ValueError("GDN layer: megatron's inference contexts and packed_seq_params are not supported "
                             "(packed rows come through the attention mask)")
        s, b, _ = hidden_states.shape
        proj, _ = self.in_proj(hidden_states)  # [s, b, local rows]
        proj = proj.transpose(0, 1).reshape(1, b * s, -1)  # the rows end to end
        qk, v, nv = self.nk_local * self.dk, self.nv_local * self.dv, self.nv_local
        mixed, z, beta, a = proj.split([2 * qk + v, v, nv, nv], dim=-1)
        cu, starts = sequence_offsets(attention_mask, b, s, hidden_states.device)
        mixed = F.silu(causal_conv1d(mixed[0], self.conv1d.weight[:, 0], starts))[None]
        q, k, v = mixed.split([qk, qk, v], dim=-1)
        q = q.reshape(1, b * s, self.nk_local, self.dk)
        k = k.reshape(1, b * s, self.nk_local, self.dk)
        v = v.reshape(1, b * s, self.nv_local, self.dv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o, _ = self._kernel(hidden_states)(q, k, v, g, beta.float().sigmoid(), cu_seqlens=cu,
                                           use_qk_l2norm_in_kernel=True)
        o = o.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.out_norm.weight
        if self.tp > 1:  # shared by every rank's heads: its gradient is the sum of theirs (identity forward)
            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight)
        o = (weight.float() * o) * F.silu(z.reshape(1, b * s, self.nv_local, self.dv).float())
        o = o.to(hidden_states.dtype).reshape(b, s, -1).transpose(0, 1).contiguous()
        out, _ = self.out_proj(o)
        return out, None


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight is stored as its offset from one, ``x / rms(x) * (1 + weight)`` computed in fp32
    (Qwen3-Next's and Qwen3.5's norms, except the GDN output norm): built where megatron's layer specs take a
    norm, so checkpoints map weight for weight."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **kwargs: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)  # Megatron's mark, not in torch's types

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)
