"""The checks that need an NVIDIA GPU and a full SGLang install (``pip install -e .[sglang]``), run by
``scripts/gpu-check``, which appends their figures to benchmarks/RESULTS.md. Each is skipped, with its
reason, where the machine cannot run it. Not run on a GPU yet: no GPU has been lent to this project's
sessions that had these checks.

* SGLang launched from a topology (two groups) behind sglang-router, generating with log-probs;
* every built-in weight transport (tensor with CUDA IPC handles, broadcast over NCCL, disk) pushing into
  SGLang, verified, and the engine's log-probs after the push matching HF's under the pushed weights;
* colocated offload: SGLang launched with the memory saver releases and resumes its GPU memory;
* the Megatron trainer in bf16 over NCCL against the fp32 CPU trainer on one batch.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU checks run on a machine with an NVIDIA GPU (scripts/gpu-check)",
                allow_module_level=True)


def record(check: str, **figures) -> None:
    """A check's figures, for scripts/gpu-check to put in benchmarks/RESULTS.md."""
    path = os.environ.get("RLX_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"check": check, **figures}) + "\n")


def need_sglang() -> None:
    if importlib.util.find_spec("sgl_kernel") is None:
        pytest.skip("SGLang with its GPU dependencies is not installed (pip install -e '.[sglang]')")


def run(coro):
    return asyncio.run(coro)


def fleet_for(tmp_path, groups, **rollout):
    from rlx.config import parse_config
    from rlx.rollout.engines.fleet import EngineFleet

    cfg = parse_config(json.dumps({"model": {"path": "builtin://tiny-qwen3"},
                                   "rollout": {"engines": groups, "startup_timeout_s": 600, **rollout}}))
    return EngineFleet(cfg, tmp_path / "logs")


def test_sglang_topology_behind_the_router(tmp_path):
    need_sglang()
    from rlx.rollout.engines.protocol import GenerateRequest

    fleet = fleet_for(tmp_path, [{"name": "a", "backend": "sglang", "mem_fraction_static": 0.3},
                                 {"name": "b", "backend": "sglang", "mem_fraction_static": 0.3}])
    t0 = time.monotonic()
    run(fleet.start())
    try:
        started = time.monotonic() - t0
        assert fleet.router is not None and len(fleet.engines) == 2

        async def go():
            async with fleet.client() as c:
                t = time.monotonic()
                outs = await asyncio.gather(*(c.generate(GenerateRequest([5, 6, 7 + i], {
                    "max_new_tokens": 32, "ignore_eos": True})) for i in range(64)))
                return outs, time.monotonic() - t

        outs, took = run(go())
        tokens = sum(len(r.output_ids) for (r,) in outs)
        assert tokens == 64 * 32 and all(len(r.output_logprobs) == 32 for (r,) in outs)
        record("sglang topology + router", engines=2, startup_s=round(started, 1),
               tokens_per_s=round(tokens / took, 1))
    finally:
        run(fleet.stop())


@pytest.mark.parametrize("transport", ["tensor", "broadcast", "disk"])
def test_weight_transports_into_sglang(transport, tmp_path):
    need_sglang()
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import resolve_model_path
    from rlx.plugins import build_plugins
    from rlx.rollout.engines.protocol import GenerateRequest
    from rlx.transport import TransportContext
    from rlx.transport.sender import Fingerprints
    from rlx.transport.verify import verify

    fleet = fleet_for(tmp_path, [{"backend": "sglang", "mem_fraction_static": 0.4}])
    run(fleet.start())
    try:
        path = resolve_model_path("builtin://tiny-qwen3")
        state = {k: (v * 1.25).to(torch.bfloat16).cuda() for k, v in load_file(f"{path}/model.safetensors").items()}
        t_ = build_plugins().build("transports", transport)
        ctx = TransportContext(fleet.engines, tmp_path, host="127.0.0.1")
        prints = Fingerprints()

        async def push():
            await t_.setup(ctx)
            t = time.monotonic()
            await t_.send(prints.watch(iter(state.items())), 1, ctx)
            await t_.commit(1, ctx)
            took = time.monotonic() - t
            await verify(fleet.engines, prints, 1)
            await t_.close()
            return took

        took = run(push())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
        model.load_state_dict({k: v for k, v in state.items()}, strict=False)

        async def sample():
            async with fleet.client() as c:
                return (await c.generate(GenerateRequest([5, 6, 7], {"max_new_tokens": 8, "temperature": 0})))[0]

        res = run(sample())
        ids = torch.tensor([[5, 6, 7, *res.output_ids]], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float(), -1)[0, 2:-1].gather(
                -1, ids[0, 3:, None]).squeeze(-1).cpu()
        diff = (logp - torch.tensor(res.output_logprobs)).abs().max().item()
        assert res.weight_version == "1" and diff < 5e-2
        record(f"weight transport {transport} into SGLang", push_s=round(took, 3), max_logprob_diff=round(diff, 4))
    finally:
        run(fleet.stop())


def test_colocated_offload_frees_sglang_memory(tmp_path):
    need_sglang()
    fleet = fleet_for(tmp_path, [{"backend": "sglang", "mem_fraction_static": 0.5}], offload_during_train=True)
    run(fleet.start())
    try:
        from rlx.rollout.batches import SyncBatches

        batches = SyncBatches(fleet.cfg, manager=None, fleet=fleet)  # type: ignore[arg-type]
        assert batches.offload
        before = torch.cuda.mem_get_info()[0]
        run(batches.before_train())
        released = torch.cuda.mem_get_info()[0]
        run(batches.after_train())
        resumed = torch.cuda.mem_get_info()[0]
        assert released - before > 1 << 30, "SGLang freed less than 1 GiB on release"
        record("colocated offload (SGLang memory saver)", freed_gib=round((released - before) / 2**30, 2),
               taken_back_gib=round((released - resumed) / 2**30, 2))
    finally:
        run(fleet.stop())


WORKER = textwrap.dedent("""
    import json, sys
    import torch
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.trainer import Trainer
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    dtype, out = sys.argv[1], sys.argv[2]
    cfg = parse_config(json.dumps({"model": {"path": "builtin://tiny-qwen3", "dtype": dtype},
                                   "train": {"optim": {"lr": 1e-3}}}))
    trainer = Trainer(cfg, build_plugins())
    g = torch.Generator().manual_seed(0)
    groups = [Group(i, [Sample(torch.randint(3, 500, (5,), generator=g).tolist(),
                               torch.randint(3, 500, (9,), generator=g).tolist(), [1] * 9, [-6.0] * 9,
                               reward=float(j), status=SampleStatus.COMPLETED, sample_id=4 * i + j, group_id=i)
                        for j in range(4)]) for i in range(2)]
    metrics = trainer.train_step(RolloutBatch(1, groups))
    json.dump(metrics, open(out, "w"))
""")


def test_trainer_bf16_nccl_against_fp32_cpu(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = {}
    for name, dtype, env in [("cpu", "float32", {"CUDA_VISIBLE_DEVICES": ""}), ("gpu", "bfloat16", {})]:
        out = tmp_path / f"{name}.json"
        t = time.monotonic()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", str(script), dtype,
                        str(out)], check=True, env={**os.environ, **env}, timeout=600)
        results[name] = (json.loads(out.read_text()), time.monotonic() - t)
    cpu, gpu = results["cpu"][0], results["gpu"][0]
    keys = [k for k in cpu if isinstance(cpu[k], (int, float)) and k in gpu and "time" not in k]
    worst = max(abs(cpu[k] - gpu[k]) / max(abs(cpu[k]), 1e-3) for k in keys)
    assert worst < 5e-2, {k: (cpu[k], gpu[k]) for k in keys}
    record("trainer bf16/NCCL vs fp32/CPU", metrics_compared=len(keys), worst_relative_diff=round(worst, 4),
           gpu_step_s=round(results["gpu"][1], 1))


def test_gpu_kernels():
    pytest.skip("no GPU kernels ship yet: the FlashQLA kernels plugin is its own issue (Qwen3-Next / Qwen3.5)")
