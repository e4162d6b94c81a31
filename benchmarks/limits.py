"""This machine's limits, and each phase of an rlx GRPO step against the bound they set.

Measures fp32 matmul GFLOP/s (all threads; through torch's own kernel and through oneDNN, rlx's ``matmul-onednn``
kernel, the bound taking the faster: rlx's ``auto`` takes it where it pays) and memory copy GB/s, runs the
`vs_trl` workload through rlx (sync mode), and prints each phase's median time beside its bound:

- rollout: prefill of each distinct prompt once (2 FLOPs per parameter per token) at the matmul rate, plus one
  decode step per new token, each bound by its FLOPs (every sample's token through the whole model) or by reading
  every weight once (memory), whichever is slower;
- train: forward and backward (6 FLOPs per parameter per token) over every packed token, the output layer at
  response positions only;
- weight sync: the model's bytes copied twice (into shared memory, out into the engine) at the copy rate.

Attention's own FLOPs (small at these lengths) are left out, so the bounds are a little low.

    scripts/loopback .venv/bin/python benchmarks/limits.py [--model smollm2|tiny] [--metrics RUN/metrics.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vs_trl import WORKLOADS, run_rlx  # noqa: E402


def matmul_gflops(n: int = 2048, reps: int = 10) -> tuple[float, float]:
    """fp32 GFLOP/s of an ``n^3`` product through torch's own kernel and through oneDNN."""
    from rlx.builtins.matmul import OneDNNMatmul, TorchMatmul
    from rlx.train.kernel_choice import install_matmul

    a, b = torch.randn(n, n), torch.randn(n, n)
    rates = []
    for kernel in (TorchMatmul(), OneDNNMatmul()):
        install_matmul(kernel)
        a @ b
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        rates.append(2 * n**3 * reps / (time.perf_counter() - t) / 1e9)
    install_matmul(TorchMatmul())
    return rates[0], rates[1]


def copy_gbs(mb: int = 512, reps: int = 5) -> float:
    src = torch.randn(mb << 18)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return src.numel() * 4 * reps / (time.perf_counter() - t) / 1e9


def model_sizes(path: str) -> tuple[int, int, int]:
    """(parameters outside the embedding and output layer, output layer parameters, bytes of all weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlx.models.tiny import resolve_model_path

    local = resolve_model_path(path)
    cfg = AutoConfig.from_pretrained(local)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    total = sum(p.numel() for p in model.parameters())
    body = total - head * (1 if cfg.tie_word_embeddings else 2)
    return body, head, total * 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(WORKLOADS), default="smollm2")
    ap.add_argument("--metrics", type=Path, help="an rlx run's metrics.jsonl of this workload (default: run it)")
    args = ap.parse_args()
    w = WORKLOADS[args.model]

    (own, onednn), gbs = matmul_gflops(), copy_gbs()
    gflops = max(own, onednn)
    print(f"this machine: {torch.get_num_threads()} threads, fp32 matmul {own:.0f} GFLOP/s through torch's own "
          f"kernel, {onednn:.0f} through oneDNN (the bound takes {gflops:.0f}), memory copy {gbs:.1f} GB/s")
    if args.metrics:
        rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    else:
        from rlx.tasks import arithmetic, write_jsonl

        with tempfile.TemporaryDirectory(prefix="rlx-limits-") as folder:  # the run's checkpoint: GBs for SmolLM2
            tmp = Path(folder)
            rows = run_rlx(w, write_jsonl(arithmetic(512), tmp / "data.jsonl"), tmp / "run", "sync")
    rows = rows[w.warmup:]
    body, head, nbytes = model_sizes(w.model)
    samples = statistics.median(r["samples"] for r in rows)
    response = statistics.median(r["response_len/mean"] for r in rows) * samples
    prompt = statistics.median(r["tokens"] for r in rows) - response  # prompt tokens, one copy per sample
    rate = gflops * 1e9
    decode_step = max(2 * (body + head) * samples / rate, nbytes / (gbs * 1e9))
    bounds = {
        "rollout": 2 * body * prompt / w.group / rate + w.tokens * decode_step,
        "train": (6 * body * (prompt + response) + 6 * head * response) / rate,
        "weight_sync": 2 * nbytes / (gbs * 1e9),
    }
    print(f"workload: {w.model} ({body / 1e6:.1f}M body + {head / 1e6:.1f}M output-layer parameters), "
          f"{samples:.0f} samples, {prompt:.0f} prompt + {response:.0f} response tokens per step; medians of "
          f"{len(rows)} steps")
    print("| phase | rlx s | bound s | rlx / bound | cores used |")
    print("|---|---:|---:|---:|---:|")
    for phase, bound in bounds.items():
        took = statistics.median(r[f"time/{phase}_s"] for r in rows)
        cores = [r[f"cores/{phase}"] for r in rows if r.get(f"cores/{phase}") is not None]
        used = f"{statistics.median(cores):.2f}" if cores else "—"
        print(f"| {phase} | {took:.3f} | {bound:.3f} | {took / bound:.1f}x | {used} |")
    step = statistics.median(r["time/step_s"] for r in rows)
    print(f"| step | {step:.3f} | {sum(bounds.values()):.3f} | {step / sum(bounds.values()):.1f}x | |")


if __name__ == "__main__":
    main()
