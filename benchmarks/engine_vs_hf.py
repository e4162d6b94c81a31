"""Embedded engine tokens/s beside batched HF ``generate`` on the same model, at 1, 8 and 64 concurrent
requests. Each side generates exactly ``--tokens`` tokens per request (EOS ignored), sampling at
temperature 1, with the same torch thread count and the same CPU matmul kernel (``--matmul``, rlx's
``model.kernels.matmul``: the engine is started with it and this process installs it for ``generate``; auto:
oneDNN where it pays); they run one after the other, not at once. Each point is the median of 5 timed runs after
one warm-up run, the two sides alternating.

    python benchmarks/engine_vs_hf.py [--model builtin://small-qwen3] [--tokens 64] [--threads 2] [--matmul auto]

Run it inside a loopback-only namespace on shared machines (see scripts/test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

REPEATS = 5  # timed runs per point; the median is printed

def prompts(n: int, tok) -> list[list[int]]:
    return [tok.encode(f"what is {i} + {2 * i} and then {i * 7}", add_special_tokens=False) for i in range(n)]


def hf_run(model, tok, n: int, tokens: int) -> float:
    batch = prompts(n, tok)
    width = max(map(len, batch))
    pad = tok.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              pad_token_id=pad)
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        return (out.shape[1] - width) * n / (time.perf_counter() - t)


async def engine_run(client, tok, n: int, tokens: int) -> float:
    from rlx.rollout.engines.client import GenerateRequest

    params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0}
    t = time.perf_counter()
    results = await asyncio.gather(*(client.generate(GenerateRequest(p, params)) for p in prompts(n, tok)))
    return sum(len(r[0].output_ids) for r in results) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin://small-qwen3")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--matmul", default="auto", help="the CPU matmul kernel of both sides: auto, onednn or torch")
    args = ap.parse_args()

    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.models.tiny import resolve_model_path
    from rlx.rollout.engines.launch import ManagedProcess, embedded_command, free_port, wait_healthy

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from rlx.plugins import build_plugins
    from rlx.train.kernel_choice import use_matmul

    matmul = use_matmul(build_plugins(), args.matmul, model.device, torch.float32,
                        model.config.get_text_config().hidden_size).name.removeprefix("matmul-")

    port = free_port()
    proc = ManagedProcess(embedded_command(path, port, server_args={"num_threads": args.threads,
                                                                    "max_running_requests": max(args.concurrency),
                                                                    "kernels": json.dumps({"matmul": matmul})}),
                          Path("/tmp") / f"rlx-bench-engine-{port}.log")
    proc.start()
    hf: dict[int, float] = {}
    eng: dict[int, float] = {}

    async def measure(url: str) -> None:
        from rlx.rollout.engines.client import EngineClient

        async with EngineClient(url) as client:
            for n in args.concurrency:
                # Alternate the two so that machine noise falls on both alike; the first pair warms up.
                pairs = [(hf_run(model, tok, n, args.tokens), await engine_run(client, tok, n, args.tokens))
                         for _ in range(REPEATS + 1)][1:]
                hf[n] = statistics.median(p[0] for p in pairs)
                eng[n] = statistics.median(p[1] for p in pairs)

    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(url, proc, 300))
        asyncio.run(measure(url))
    finally:
        proc.stop()

    print(f"model {args.model}, {args.tokens} tokens per request, {args.threads} torch threads, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}, matmul kernel {matmul} on both sides")
    print(f"{'concurrent':>10} | {'rlx engine tok/s':>16} | {'HF generate tok/s':>17} | {'ratio':>6}")
    for n in args.concurrency:
        print(f"{n:>10} | {eng[n]:>16.1f} | {hf[n]:>17.1f} | {eng[n] / hf[n]:>6.2f}")


if __name__ == "__main__":
    main()
