"""Which engine to use on a CPU: rlx's embedded engine against a live SGLang 0.5.23 server, the same model and
requests, side by side in one run.

    scripts/sglang-cpu-env                                              # once: SGLang's CPU environment
    scripts/loopback .venv/bin/python benchmarks/engines_cpu.py [--model smollm2] [--sglang-python PY]

Each engine is started as `rl train` starts it (`EngineFleet._command`: fp32, one engine with the machine's
threads; SGLang with `--device cpu`, its overlap scheduler off and a bounded KV pool), alone on the machine.
Printed per engine: seconds to healthy, decode tokens/s with 1, 8 and 32 requests in flight (64 new tokens
each, EOS ignored, temperature 1, log-probs returned as rlx asks for them), a weight push from disk
(`/update_weights_from_disk` of the model's own checkpoint, the `disk` transport's call), and how far the
engine's log-probs of its sampled tokens are from an fp32 forward (the trainer's on a CPU); `--dtype bfloat16`
serves both in bf16.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))
ROOT = Path(__file__).resolve().parents[1]
MODELS = {"tiny": "builtin://tiny-qwen3", "smollm2": "builtin://smollm2-135m-instruct"}


async def measure(url: str, model_path: str, concurrency: list[int], new_tokens: int) -> dict:
    from rlx.rollout.engines.client import EngineClient, GenerateRequest

    out: dict = {}
    async with EngineClient(url, timeout_s=600) as c:
        await c.generate(GenerateRequest([11, 12, 13], {"max_new_tokens": 4}))  # warm-up
        for n in concurrency:
            reqs = [GenerateRequest([11 + i % 50, 12, 13, 14 + i % 7, 15, 16, 17, 18],
                                    {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0})
                    for i in range(n)]
            t = time.perf_counter()
            res = await asyncio.gather(*(c.generate(r) for r in reqs))
            dt = time.perf_counter() - t
            out[n] = sum(len(r[0].output_ids) for r in res) / dt
            if n == 1:
                out["lp_diff"] = logprob_diff(model_path, reqs[0].input_ids, res[0][0])
        t = time.perf_counter()
        await c.update_weights_from_disk(model_path, weight_version="1")
        out["push_s"] = time.perf_counter() - t
    return out


def logprob_diff(model_path: str, prompt: list[int], res) -> float:
    """The largest difference between the engine's log-probs of its sampled tokens and an fp32 forward of
    transformers (the trainer's precision on a CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + res.output_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(res.output_ids)[:, None])[:, 0]
    return float((ref - torch.tensor(res.output_logprobs)).abs().max())


def run_engine(backend: str, model: str, python: str | None, concurrency: list[int], new_tokens: int,
               dtype: str) -> dict:
    from rlx.config import parse_config
    from rlx.models.tiny import resolve_model_path
    from rlx.rollout.engines.fleet import EngineFleet
    from rlx.rollout.engines.launch import HOST, ManagedProcess, free_port, wait_healthy

    path = resolve_model_path(model)
    cfg = parse_config(f"model: {{path: {path}, dtype: {dtype}}}\nray: {{enabled: false}}\n"
                       f"rollout: {{n_prompts: 8, n_samples_per_prompt: 4, sampling: {{max_new_tokens: {new_tokens}}},"
                       f" engines: [{{backend: {backend}{', python: ' + python if python else ''}}}]}}")
    g = cfg.rollout.engines[0]
    with tempfile.TemporaryDirectory() as tmp:
        fleet = EngineFleet(cfg, Path(tmp))
        port = free_port()
        proc = ManagedProcess(fleet._command(g, HOST, port), Path(tmp) / "engine.log")
        t = time.perf_counter()
        proc.start(fleet._env(g))
        try:
            url = f"http://{HOST}:{port}"
            asyncio.run(wait_healthy(url, proc, 600, what=backend))
            ready = time.perf_counter() - t
            figures = asyncio.run(measure(url, path, concurrency, new_tokens))
        finally:
            proc.stop()
    return {"backend": backend, "ready_s": ready, **figures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="tiny")
    ap.add_argument("--sglang-python", default=os.environ.get("RLX_SGLANG_PYTHON", str(ROOT / ".sglang-cpu/bin/python")))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both engines serve in it")
    args = ap.parse_args()
    if not Path(args.sglang_python).exists():
        sys.exit(f"no SGLang interpreter at {args.sglang_python}: run scripts/sglang-cpu-env first")
    concurrency = [1, 8, 32]
    rows = [run_engine(backend, MODELS[args.model], python, concurrency, args.new_tokens, args.dtype)
            for backend, python in (("embedded", None), ("sglang", args.sglang_python))]
    print(f"\n{args.model} ({MODELS[args.model]}), {args.dtype}, {args.new_tokens} new tokens a request, "
          f"{os.cpu_count()} CPUs")
    print("| engine | start-up s | tokens/s, 1 in flight | 8 in flight | 32 in flight | weight push from disk s | "
          "max log-prob diff vs fp32 forward |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        name = "embedded (rlx)" if r["backend"] == "embedded" else "SGLang 0.5.23 (live, --device cpu)"
        print(f"| {name} | {r['ready_s']:.1f} | {r[1]:.0f} | {r[8]:.0f} | {r[32]:.0f} | {r['push_s']:.3f} | "
              f"{r['lp_diff']:.1e} |")


if __name__ == "__main__":
    main()
