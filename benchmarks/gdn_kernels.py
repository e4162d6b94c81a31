"""Gated delta net (GDN) kernel time per layer, beside a full-attention layer of the same size.

    .venv/bin/python benchmarks/gdn_kernels.py                       # CPU: torch chunked and recurrent vs SDPA
    .venv/bin/python benchmarks/gdn_kernels.py --tokens 4096 --heads 16 --dim 128   # on a GPU: + FlashQLA, fla

For one layer's core (no projections): the gated delta rule through every kernel of ``rlx-kernel-flashqla`` that
can run here (``gdn-flashqla``, ``gdn-fla`` on CUDA; ``gdn-torch`` everywhere, and the token-by-token recurrence
it is tested against), and causal scaled-dot-product attention with the same heads and head size. Sequences are
packed (``--seqs`` of them in ``--tokens``, cu_seqlens for the GDN kernels, a block-causal mask for attention on
CPU, one SDPA call per sequence on GPU). Prints the median forward and forward+backward time of ``--repeats``
runs after a warm-up, in milliseconds, and tokens per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64, help="head size (keys and values)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--recurrent-tokens", type=int, default=512,
                    help="the token-by-token reference runs on this many tokens (it is slow), scaled to --tokens")
    args = ap.parse_args()

    from rlx.plugins import build_plugins
    from rlx.train.kernel_choice import candidates
    from rlx_kernel_flashqla.torch_gdn import recurrent_gated_delta_rule

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t, h, d = args.tokens, args.heads, args.dim
    bounds = torch.linspace(0, t, args.seqs + 1).long()
    cu = bounds.to(device)

    def make(length: int):
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(1, length, h, d, generator=g) for _ in range(2))
        k = F.normalize(k, dim=-1)
        v = torch.randn(1, length, h, d, generator=g)
        decay, beta = -torch.rand(1, length, h, generator=g) * 0.5, torch.rand(1, length, h, generator=g)
        return [x.to(device, dtype if x.dim() == 4 else torch.float32).requires_grad_() for x in (q, k, v, decay,
                                                                                                   beta)]

    rows: list[tuple[str, float, float, int]] = []

    def measure(name: str, fn, xs, tokens: int, scale: float = 1.0) -> None:
        def fwd():
            with torch.no_grad():
                fn(*xs)

        def fwd_bwd():
            out = fn(*xs)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()

        rows.append((name, timed(fwd, args.repeats, device) * scale, timed(fwd_bwd, args.repeats, device) * scale,
                     tokens))

    xs = make(t)
    plugins = build_plugins()
    for kernel in candidates(plugins, "gdn"):
        reason = kernel.supports(device=device, dtype=dtype)
        if reason is not None:
            print(f"{kernel.name}: not run ({reason})")
            continue
        measure(kernel.name, lambda *a, k=kernel: k(*a, cu_seqlens=cu), xs, t)
    short = min(args.recurrent_tokens, t)
    measure(f"recurrent reference (x{t / short:.1f} from {short} tokens)",
            lambda *a: recurrent_gated_delta_rule(*a), make(short), t, scale=t / short)

    q, k, v = (torch.randn(1, h, t, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    lengths = (bounds[1:] - bounds[:-1]).tolist()
    if device.type == "cuda":
        def attention(q, k, v):
            parts = zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True)
            return torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True) for a, b, c in parts], 2)
    else:
        mask = torch.zeros(t, t, dtype=torch.bool)
        for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            mask[s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()

        def attention(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    measure("full attention (SDPA, same heads and head size)", attention, [q, k, v], t)

    print(f"\n{device.type}, {dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}: {t} tokens in "
          f"{args.seqs} sequences, {h} heads of {d}")
    print(f"{'kernel':<52} {'fwd ms':>9} {'fwd+bwd ms':>11} {'fwd tok/s':>11}")
    for name, f, fb, tokens in rows:
        print(f"{name:<52} {f:>9.1f} {fb:>11.1f} {tokens / f * 1e3:>11.0f}")


if __name__ == "__main__":
    main()
