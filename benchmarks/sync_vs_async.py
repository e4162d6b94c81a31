"""Sync against async training on a workload with long-tailed generation times, side by side.

The workload is an agent-like generator: each sample takes `TURNS` turns, each a short generate call
on the engine followed by a "tool call" whose latency is long-tailed (usually tens of milliseconds,
sometimes seconds), the tool result appended as non-model tokens. Everything else is the quickstart's:
the built-in tiny Qwen3-shaped model, arithmetic prompts, GRPO, the digits reward, the embedded engine
and Megatron on CPU, the trainer in this process (`ray.enabled: false`, the same for both).

Both runs use the same prompts per step, group size, token budget, tool-latency draws (seeded by
sample id) and cap on samples in flight (`rollout.requests.max_concurrency`). Sync mode waits for the slowest
sample of every step and then trains while nothing generates; async mode keeps generating, up to
`max_staleness` steps ahead, while the trainer trains. Throughput is trained samples per second of
step time (start-up excluded), after warm-up steps that are not counted.

    scripts/loopback .venv/bin/python benchmarks/sync_vs_async.py [--steps 14] [--warmup 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import types
from pathlib import Path

PROMPTS, GROUP, TOKENS, TURNS, STALENESS = 4, 8, 8, 3, 4
CONCURRENCY = PROMPTS * GROUP * 2


def tool_latency(rng: random.Random) -> float:
    """Seconds one tool call takes: mostly fast, a long tail (5% of calls take 1.5-3 s)."""
    return rng.uniform(1.5, 3.0) if rng.random() < 0.05 else rng.expovariate(1 / 0.05)


class ToolTurns:
    """TURNS x (generate a few tokens, wait for a tool, append its result as non-model tokens)."""

    name = "bench_tool_turns"

    async def generate(self, ctx, sample):
        from rlx.rollout.context import append_env_tokens, append_model_tokens

        rng = random.Random(sample.sample_id)
        for turn in range(TURNS):
            params = ctx.sampling_params(max_new_tokens=TOKENS)
            res = await ctx.generate(sample.prompt_ids + sample.response_ids, params, ctx.new_rid(sample))
            append_model_tokens(sample, res)
            if turn < TURNS - 1:
                await asyncio.sleep(tool_latency(rng))
                append_env_tokens(sample, ctx.tokenizer.encode(f"\n= {rng.randint(0, 99)}\n",
                                                               add_special_tokens=False))
        ids = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
        sample.response_text = ctx.tokenizer.decode(ids, skip_special_tokens=True)
        return [sample]


def plugins():
    from rlx import hookimpl
    from rlx.plugins import build_plugins

    mod = types.ModuleType("bench-tool-turns")
    mod.register_generators = hookimpl(lambda register: register(ToolTurns))
    return build_plugins(extra=[("bench-tool-turns", mod)])


def run(mode: str, data: Path, out: Path, steps: int) -> list[dict]:
    from rlx.config import parse_config
    from rlx.orchestrate.loop import train
    from rlx.orchestrate.metrics import read

    train_cfg = {"num_steps": steps, "optim": {"lr": 1e-3}, "checkpoint": {"interval": 0}, "mode": mode}
    if mode == "async":
        train_cfg["async"] = {"max_staleness": STALENESS}
    cfg = parse_config(json.dumps({
        "run": {"output_dir": str(out), "seed": 1},
        "model": {"path": "builtin://tiny-qwen3"},
        "data": {"path": str(data)},
        "rollout": {"n_prompts": PROMPTS, "n_samples_per_prompt": GROUP, "rewards": ["digits"],
                    "generator": "bench_tool_turns", "requests": {"max_concurrency": CONCURRENCY},
                    "sampling": {"max_new_tokens": TOKENS * TURNS, "temperature": 1.0},
                    "engines": [{"server_args": {"num_threads": 1}}]},
        "train": train_cfg,
        "ray": {"enabled": False},
    }))
    asyncio.run(train(cfg, plugins()))
    return read(out)


def summary(rows: list[dict], warmup: int) -> dict[str, float]:
    timed = rows[warmup:]
    seconds = sum(r["time/step_s"] for r in timed)
    samples = sum(r["samples"] for r in timed)
    return {"steps": len(timed), "seconds": seconds, "samples": samples, "samples_per_s": samples / seconds,
            "s_per_step": seconds / len(timed), "reward_last": timed[-1]["reward/mean"],
            "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in timed) / len(timed),
            "stale_groups": sum(r.get("async/stale_groups", 0.0) for r in timed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    from rlx.tasks import arithmetic, write_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        data = write_jsonl(arithmetic(2000, seed=5), Path(tmp) / "data.jsonl")
        results = {mode: summary(run(mode, data, Path(tmp) / mode, args.steps), args.warmup)
                   for mode in ("sync", "async")}

    print(f"\nworkload: {PROMPTS} prompts x {GROUP} samples a step, {TURNS} turns of <= {TOKENS} tokens, "
          f"long-tailed tool latency (5% of calls 1.5-3 s), {CONCURRENCY} samples in flight at most; "
          f"{args.steps} steps, first {args.warmup} not timed; async max_staleness {STALENESS}")
    print(f"{'':18}{'sync':>12}{'async':>12}")
    for key, fmt in (("samples_per_s", "{:.1f}"), ("s_per_step", "{:.2f}"), ("samples", "{:.0f}"),
                     ("staleness_mean", "{:.2f}"), ("stale_groups", "{:.0f}"), ("reward_last", "{:.3f}")):
        print(f"{key:18}{fmt.format(results['sync'][key]):>12}{fmt.format(results['async'][key]):>12}")
    ratio = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"async / sync samples per second: {ratio:.2f}x")


if __name__ == "__main__":
    main()
