"""SGLang on the GPU, for `tests/gpu/check.py`: where SGLang is installed (``pip install 'rlx[sglang]'``); it is not
in the GPU bundle (with its CUDA kernels it is far over the size limit), so the lent machine skips these."""

from __future__ import annotations

import json
import time
from typing import Any

from checks import DENSE, Ctx, run_async


def sglang_fleet(ctx: Ctx, groups: list[dict[str, Any]], **rollout: Any) -> Any:
    from rlx.config import parse_config
    from rlx.rollout.engines.fleet import EngineFleet

    cfg = parse_config(json.dumps({"model": {"path": DENSE}, "ray": {"enabled": False},
                                   "run": {"output_dir": str(ctx.work / "run")},
                                   "rollout": {"engines": groups, "startup_timeout_s": 600, **rollout}}))
    return EngineFleet(cfg, ctx.work / "logs")


def check_sglang_router(ctx: Ctx) -> None:
    """Pass: two SGLang groups launched from a topology behind sglang-router serve 64 requests of 32 tokens, each
    with a log-prob per token."""
    import asyncio

    from rlx.rollout.engines.client import GenerateRequest

    fleet = sglang_fleet(ctx, [{"name": "a", "backend": "sglang", "mem_fraction_static": 0.3},
                               {"name": "b", "backend": "sglang", "mem_fraction_static": 0.3}])
    t0 = time.monotonic()
    run_async(fleet.start())
    try:
        ctx.fig(engines=len(fleet.engines), startup_s=time.monotonic() - t0)

        async def go():
            async with fleet.client() as c:
                t = time.monotonic()
                outs = await asyncio.gather(*(c.generate(GenerateRequest([5, 6, 7 + i], {
                    "max_new_tokens": 32, "ignore_eos": True})) for i in range(64)))
                return [r for (r,) in outs], time.monotonic() - t

        outs, took = run_async(go())
        ctx.fig(tokens_per_s=sum(len(r.output_ids) for r in outs) / took)
        ctx.expect(fleet.router is not None and len(fleet.engines) == 2, "not two engines behind the router")
        ctx.expect(all(len(r.output_ids) == 32 == len(r.output_logprobs) for r in outs), "short or unscored outputs")
    finally:
        run_async(fleet.stop())


def check_sglang_transports(ctx: Ctx) -> None:
    """Pass: each built-in transport (tensor with CUDA IPC handles, broadcast over NCCL, disk) pushes a changed
    model into SGLang, verified, after which SGLang's greedy log-probs match HF's under the pushed weights within
    0.05."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import resolve_model_path
    from rlx.plugins import build_plugins
    from rlx.rollout.engines.client import GenerateRequest
    from rlx.transport import TransportContext
    from rlx.transport.verify import Fingerprints
    from rlx.transport.verify import verify

    path = resolve_model_path(DENSE)
    state = {k: (v * 1.25).to(torch.bfloat16).cuda() for k, v in load_file(f"{path}/model.safetensors").items()}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    model.load_state_dict(state, strict=False)
    for version, name in enumerate(("tensor", "broadcast", "disk"), start=1):
        fleet = sglang_fleet(ctx, [{"backend": "sglang", "mem_fraction_static": 0.4}])
        run_async(fleet.start())
        try:
            transport = build_plugins().build("transports", name)
            tctx = TransportContext(fleet.engines, ctx.work, host="127.0.0.1")
            prints = Fingerprints()

            async def push():
                await transport.setup(tctx)
                t = time.monotonic()
                await transport.send(prints.watch(iter(state.items())), version, tctx)
                await transport.commit(version, tctx)
                took = time.monotonic() - t
                await verify(fleet.engines, prints, version)
                await transport.close()
                return took

            took = run_async(push())

            async def sample():
                async with fleet.client() as c:
                    return (await c.generate(GenerateRequest([5, 6, 7], {"max_new_tokens": 8, "temperature": 0})))[0]

            res = run_async(sample())
            ids = torch.tensor([[5, 6, 7, *res.output_ids]], device="cuda")
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits.float(), -1)[0, 2:-1].gather(
                    -1, ids[0, 3:, None]).squeeze(-1).cpu()
            diff = float((logp - torch.tensor(res.output_logprobs)).abs().max())
            ctx.fig(**{f"{name}_push_s": took, f"{name}_max_logprob_diff": diff})
            ctx.expect(res.weight_version == str(version) and diff < 0.05, f"{name}: version "
                       f"{res.weight_version}, log-prob difference {diff:.4f}")
        finally:
            run_async(fleet.stop())


def check_sglang_offload(ctx: Ctx) -> None:
    """Pass: SGLang launched with its memory saver (rollout.offload_during_train) frees over 1 GiB of GPU memory when
    released for a train step and takes it back after."""
    import torch

    from rlx.rollout.batches import SyncBatches

    fleet = sglang_fleet(ctx, [{"backend": "sglang", "mem_fraction_static": 0.5}], offload_during_train=True)
    run_async(fleet.start())
    try:
        batches = SyncBatches(fleet.cfg, manager=None, fleet=fleet)  # type: ignore[arg-type]
        before = torch.cuda.mem_get_info()[0]
        run_async(batches.before_train())
        released = torch.cuda.mem_get_info()[0]
        run_async(batches.after_train())
        resumed = torch.cuda.mem_get_info()[0]
        ctx.fig(freed_gib=(released - before) / 2**30, taken_back_gib=(released - resumed) / 2**30)
        ctx.expect(released - before > 1 << 30, "SGLang freed less than 1 GiB on release")
    finally:
        run_async(fleet.stop())


def check_sglang_fp8(ctx: Ctx) -> None:
    """Pass: SGLang launched for FP8 rollout (``rollout.quantization: fp8``: from the FP8 copy rlx writes, with
    ``--quantization fp8``) takes a quantised tensor push of a changed model, verified, after which its greedy
    log-probs are within 0.25 of HF's under the dequantised pushed weights (SGLang's FP8 kernels also quantise the
    activations)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlx.models.fp8 import SCALE, dequantize, quantized, served, stored_quantised
    from rlx.models.tiny import resolve_model_path
    from rlx.plugins import build_plugins
    from rlx.rollout.engines.client import GenerateRequest
    from rlx.transport import TransportContext
    from rlx.transport.verify import Fingerprints, verify

    path = resolve_model_path(DENSE)
    fleet = sglang_fleet(ctx, [{"backend": "sglang", "mem_fraction_static": 0.4}], quantization="fp8")
    run_async(fleet.start())
    try:
        block, names = stored_quantised(served(path, ctx.work / "run"))
        state = {k: (v * 1.25).to(torch.bfloat16) for k, v in load_file(f"{path}/model.safetensors").items()}
        pushed = dict(quantized(state.items(), block, names.__contains__))
        transport = build_plugins().build("transports", "tensor")
        tctx = TransportContext(fleet.engines, ctx.work, host="127.0.0.1")
        prints = Fingerprints()

        async def push():
            await transport.setup(tctx)
            await transport.send(prints.watch(iter(pushed.items())), 1, tctx)
            await transport.commit(1, tctx)
            await verify(fleet.engines, prints, 1)
            await transport.close()

        run_async(push())

        async def sample():
            async with fleet.client() as c:
                return (await c.generate(GenerateRequest([5, 6, 7], {"max_new_tokens": 8, "temperature": 0})))[0]

        res = run_async(sample())
        served_state = {n: (dequantize(pushed[n], pushed[n + SCALE], block) if n in names else t).to(torch.bfloat16)
                        for n, t in state.items()}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
        model.load_state_dict({k: v.cuda() for k, v in served_state.items()}, strict=False)
        ids = torch.tensor([[5, 6, 7, *res.output_ids]], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float(), -1)[0, 2:-1].gather(-1, ids[0, 3:, None]).squeeze(-1)
        diff = float((logp.cpu() - torch.tensor(res.output_logprobs)).abs().max())
        ctx.fig(pushed_mb=sum(t.numel() * t.element_size() for t in pushed.values()) / 2**20,
                bf16_mb=sum(t.numel() * 2 for t in state.values()) / 2**20, max_logprob_diff=diff)
        ctx.expect(res.weight_version == "1" and diff < 0.25, f"version {res.weight_version}, log-prob difference "
                                                             f"{diff:.4f}")
    finally:
        run_async(fleet.stop())


def check_sglang_speculative(ctx: Ctx) -> None:
    """Pass: SGLang launched with n-gram speculative decoding (``speculative: {method: ngram}``: its NGRAM options)
    answers 16 greedy requests of repetitive prompts with SGLang's speculative counts in meta_info (rlx's
    ``rollout/spec_accept_rate`` reads them), log-probs within 0.05 of HF's bf16 forward. Figures: acceptance, tokens
    per verify step, tokens/s."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import resolve_model_path
    from rlx.rollout.engines.client import GenerateRequest

    fleet = sglang_fleet(ctx, [{"backend": "sglang", "mem_fraction_static": 0.4, "speculative": {"method": "ngram"}}])
    run_async(fleet.start())
    try:
        async def go():
            async with fleet.client() as c:
                t = time.monotonic()
                outs = await asyncio.gather(*(c.generate(GenerateRequest([5 + i, 6, 7, 8] * 6, {
                    "max_new_tokens": 48, "ignore_eos": True, "temperature": 0})) for i in range(16)))
                return [r for (r,) in outs], time.monotonic() - t

        outs, took = run_async(go())
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(DENSE), dtype=torch.bfloat16).cuda().eval()
        worst = 0.0
        for i, r in enumerate(outs):
            prompt = [5 + i, 6, 7, 8] * 6
            ids = torch.tensor([prompt + r.output_ids], device="cuda")
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            want = lp[len(prompt) - 1:-1].gather(1, ids[0, len(prompt):, None])[:, 0].cpu()
            worst = max(worst, float((want - torch.tensor(r.output_logprobs)).abs().max()))
        spec = [r.spec for r in outs if r.spec is not None]
        verify, proposed, correct = (sum(x[i] for x in spec) for i in range(3))
        ctx.fig(tokens_per_s=sum(len(r.output_ids) for r in outs) / took, max_logprob_diff=worst,
                accept_rate=correct / max(proposed, 1), tokens_per_verify=48 * len(spec) / max(verify, 1))
        ctx.expect(len(spec) == len(outs) and worst < 0.05, f"{len(spec)} of {len(outs)} results with speculative "
                                                            f"counts, log-prob difference {worst:.4f}")
    finally:
        run_async(fleet.stop())
