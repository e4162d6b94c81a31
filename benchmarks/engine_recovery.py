"""Time from an engine's death (SIGKILL) or freeze (SIGSTOP) to the rollout being healthy again, with
``rollout.fault_tolerance`` on, beside the same fault with it off (how rlx behaved before: the run ends, or
hangs until ``rollout.requests.timeout_s``).

    .venv/bin/python benchmarks/engine_recovery.py            # tiny model, two embedded engines, router
    .venv/bin/python benchmarks/engine_recovery.py --probe-interval 1 --failures 3

Two embedded engines behind sglang-router (round robin) generate rollout steps back to back (4 prompts x 2
samples, 64 tokens each). Once a step has finished, engine 0 gets the signal. Printed per fault, over a
window after it: seconds to the engine being taken out and to it serving again (restarted, healthy, back
in the router), the rollout steps finished in the window, the requests sent again, and whether the
rollout failed. With fault tolerance off the router alone routes around a dead engine (sglang-router's
own retries) but never gets it back, a frozen one holds its requests until ``rollout.requests.timeout_s``, and in
`rl train` the next weight push to the dead engine ends the run.
Without a trainer there is no catch-up push; `rl train` adds one push of the model to the restarted engine
(``time/weight_sync_s`` of a step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))


def config(folder: Path, enabled: bool, interval: float, failures: int, patience: float):
    from rlx.config import parse_config
    from rlx.tasks import arithmetic, write_jsonl

    data = write_jsonl(arithmetic(400), folder / "data.jsonl")
    doc = {"run": {"output_dir": str(folder / "run")}, "model": {"path": "builtin://tiny-qwen3"},
           "data": {"path": str(data)},
           "rollout": {"n_prompts": 4, "n_samples_per_prompt": 2, "rewards": ["exact_match"],
                       "sampling": {"max_new_tokens": 64, "ignore_eos": True},
                       "engines": [{"num_engines": 2, "server_args": {"num_threads": 1}}],
                       "router": {"policy": "round_robin"}, "requests": {"timeout_s": patience},
                       "fault_tolerance": {"enabled": enabled, "probe_interval_s": interval,
                                           "probe_timeout_s": interval * 2, "failures": failures}}}
    return parse_config(json.dumps(doc))


async def one(cfg, sig: int, window: float) -> dict:
    from rlx.plugins import build_plugins
    from rlx.rollout.session import RolloutSession

    out: dict = {}
    async with RolloutSession(cfg, build_plugins()) as s:
        steps: list[float] = []

        async def generate() -> None:
            step = 0
            while True:
                step += 1
                await s.manager.next_batch(step)
                steps.append(time.monotonic())

        task = asyncio.create_task(generate())
        while not steps:
            await asyncio.sleep(0.05)
            if task.done():
                task.result()
        victim = s.fleet.engines[0]
        pid = victim.process.pid
        t0 = time.monotonic()
        os.kill(pid, sig)
        health = s.fleet.health
        while time.monotonic() - t0 < window and not task.done():  # the window after the fault
            await asyncio.sleep(0.05)
        if task.done() and task.exception() is not None:
            e = task.exception()
            out["ended"] = f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {str(e)[:100]}"
        out["steps"] = sum(t > t0 for t in steps)
        if health is not None:
            out["taken_out_s"] = health.down_times[0] - t0 if health.down_times else None
            out["healthy_s"] = (health.down_times[0] - t0 + health.recovered_s[0]) if health.recovered_s else None
            out["resent"] = health.counts["rollout/resent_requests"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        try:
            os.kill(pid, signal.SIGKILL)  # a frozen victim without fault tolerance
        except ProcessLookupError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe-interval", type=float, default=0.5)
    ap.add_argument("--failures", type=int, default=2)
    ap.add_argument("--window", type=float, default=20.0, help="seconds watched after the fault")
    ap.add_argument("--request-timeout", type=float, default=60.0, help="rollout.requests.timeout_s")
    args = ap.parse_args()
    rows = []
    for name, sig in (("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
        for enabled in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = config(Path(tmp), enabled, args.probe_interval, args.failures, args.request_timeout)
                rows.append((name, enabled, asyncio.run(one(cfg, sig, args.window))))
    print(f"\ntwo embedded engines behind sglang-router; probe every {args.probe_interval:g}s, "
          f"out after {args.failures} failed probes; requests.timeout_s {args.request_timeout:g}; steps counted "
          f"in the {args.window:g}s after the fault\n")
    print(f"{'fault':8} {'fault tolerance':16} {'taken out':>10} {'healthy':>9} {'steps meanwhile':>16} "
          f"{'resent':>7}  outcome")
    for name, enabled, r in rows:
        def s(v):
            return f"{v:.1f}s" if isinstance(v, float) else "-"

        outcome = r.get("ended", "goes on")
        print(f"{name:8} {'on' if enabled else 'off (before)':16} {s(r.get('taken_out_s')):>10} "
              f"{s(r.get('healthy_s')):>9} {r.get('steps', '-')!s:>16} {r.get('resent', '-')!s:>7}  {outcome}")


if __name__ == "__main__":
    main()
