"""The gated delta rule in plain torch: a chunked form for training and prefill, and the token-by-token recurrence
it must equal (the reference). Both run anywhere torch does, forward and backward (autograd), with packed
variable-length sequences.

Per value head, with the state ``S`` a ``[K, V]`` matrix, for each token t::

    S <- exp(g_t) * S                       (decay; g_t <= 0)
    u_t = beta_t * (v_t - S^T k_t)          (the delta: what the state does not yet predict)
    S <- S + k_t u_t^T                      (write)
    o_t = S^T (scale * q_t)

Chunked form (chunks of C tokens, state S0 entering the chunk, gamma_i the cumulative log decay inside the chunk):
the deltas U of the chunk solve ``(I + A) U = beta*V - beta*(exp(gamma)*K) S0`` with the strictly lower-triangular
``A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j``; then ``O = (exp(gamma)*Q) S0 + (QK^T * D) U`` with
``D_ij = exp(gamma_i - gamma_j)`` for ``j <= i``, and ``S_C = exp(gamma_C) S0 + (exp(gamma_C - gamma)*K)^T U``.
One triangular solve per chunk replaces C sequential steps; chunks run in order.

Shapes follow flash-linear-attention and FlashQLA: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (HV a multiple of H:
each query/key head serves HV/H consecutive value heads), g and beta ``[B, T, HV]``, states ``[N, HV, K, V]``.
With ``cu_seqlens`` (B = 1) the T tokens are N sequences packed end to end (offsets ``cu_seqlens``); each starts
from its own initial state (zero by default) and none sees another's tokens. Packed sequences run as a batch padded
to the longest one: a row of one long and many short sequences costs the long one's length per sequence.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """fp32, heads first ([B, HV, T, ...]), q/k repeated over their value heads, q scaled."""
    h, hv = k.shape[2], v.shape[2]
    if hv % h:
        raise ValueError(f"gated delta rule: {hv} value heads do not group over {h} query/key heads")
    if hv != h:
        q, k = q.repeat_interleave(hv // h, dim=2), k.repeat_interleave(hv // h, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def _segments(cu_seqlens, batch: int, length: int) -> list[tuple[int, int]] | None:
    if cu_seqlens is None:
        return None
    if batch != 1:
        raise ValueError(f"gated delta rule: cu_seqlens needs batch size 1 (packed sequences), got {batch}")
    bounds = [int(x) for x in cu_seqlens]
    if bounds[0] != 0 or bounds[-1] != length or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"gated delta rule: cu_seqlens {bounds} must rise from 0 to the {length} tokens")
    return list(zip(bounds, bounds[1:]))


def _unpack(x: torch.Tensor, segments: list[tuple[int, int]], longest: int) -> torch.Tensor:
    """[1, HV, T, ...] packed -> [N, HV, longest, ...], each sequence right-padded with zeros."""
    pad = [0, 0] * (x.dim() - 3)
    return torch.cat([F.pad(x[:, :, a:b], pad + [0, longest - (b - a)]) for a, b in segments])


def _pack(x: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([x[i:i + 1, :, : b - a] for i, (a, b) in enumerate(segments)], dim=2)


def _varlen(fn, q, k, v, g, beta, initial_state, segments):
    """Run `fn` on packed sequences as a batch of right-padded ones: a padded token has k = 0, beta = 0 and g = 0,
    so it neither decays nor writes the state, and the tokens before it never see it (causal)."""
    longest = max((b - a for a, b in segments), default=0)
    args = [_unpack(x, segments, longest) for x in (q, k, v, g, beta)]
    o, state = fn(*args, initial_state)
    return _pack(o, segments), state


def _chunked(q, k, v, g, beta, state, chunk_size: int):
    b, hv, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk_size
    q, k, v = (x.reshape(b, hv, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, hv, n, chunk_size), beta.reshape(b, hv, n, chunk_size)
    gamma = g.cumsum(-1)  # log decay from the chunk's start through each position
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # D, j <= i
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2)) * decay
    system = a.masked_fill(lower.logical_not() | torch.eye(chunk_size, dtype=torch.bool, device=q.device), 0.0)
    system = system + torch.eye(chunk_size, dtype=q.dtype, device=q.device)  # I + A, unit lower triangular
    w = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    z = torch.linalg.solve_triangular(system, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_in = q * gamma.exp()[..., None]  # reads the entering state
    k_out = k * (gamma[..., -1:] - gamma).exp()[..., None]  # writes, decayed to the chunk's end
    chunk_decay = gamma[..., -1].exp()[..., None, None]
    if state is None:
        state = q.new_zeros(b, hv, dk, dv)
    else:
        state = state.float()
    out = []
    for i in range(n):
        u = w[:, :, i] - z[:, :, i] @ state
        out.append(q_in[:, :, i] @ state + attn[:, :, i] @ u)
        state = state * chunk_decay[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ u
    if not out:  # no tokens at all
        return v.new_zeros(b, hv, 0, dv), state
    o = torch.stack(out, dim=2).reshape(b, hv, n * chunk_size, dv)[:, :, :t]
    return o, state


def _recurrent(q, k, v, g, beta, state):
    b, hv, t, dk = k.shape
    state = q.new_zeros(b, hv, dk, v.shape[-1]) if state is None else state.float()
    out = []
    for i in range(t):
        state = state * g[:, :, i].exp()[..., None, None]
        delta = beta[:, :, i, None] * (v[:, :, i] - (state * k[:, :, i, :, None]).sum(-2))
        state = state + k[:, :, i, :, None] * delta[..., None, :]
        out.append((state * q[:, :, i, :, None]).sum(-2))
    o = torch.stack(out, dim=2) if out else v.new_zeros(b, hv, 0, v.shape[-1])
    return o, state


def _run(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel):
    dtype = v.dtype
    b, t = k.shape[:2]
    segments = _segments(cu_seqlens, b, t)
    n = b if segments is None else len(segments)
    want = (n, v.shape[2], k.shape[3], v.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(f"gated delta rule: initial_state has shape {tuple(initial_state.shape)}, not {want} "
                         f"(one state per sequence)")
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    if segments is None:
        o, state = fn(q, k, v, g, beta, initial_state)
    else:
        o, state = _varlen(fn, q, k, v, g, beta, initial_state, segments)
    return o.transpose(1, 2).to(dtype), (state if output_final_state else None)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                           use_qk_l2norm_in_kernel: bool = False,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Outputs ``[B, T, HV, V]`` (v's dtype) and, if asked, the final states ``[N, HV, K, V]`` (fp32); computed in
    fp32. ``scale`` defaults to ``K ** -0.5``."""
    return _run(functools.partial(_chunked, chunk_size=chunk_size), q, k, v, g, beta, scale, initial_state,
                output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: float | None = None,
                               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                               cu_seqlens: torch.Tensor | None = None,
                               use_qk_l2norm_in_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference: the same arguments and results as `chunk_gated_delta_rule`, one token at a time."""
    return _run(_recurrent, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel)
