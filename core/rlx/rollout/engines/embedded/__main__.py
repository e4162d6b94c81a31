"""Command line of the embedded engine; flags mirror ``sglang.launch_server`` where they overlap."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlx.rollout.engines.embedded",
                                description="rlx embedded engine (SGLang-compatible HTTP API)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path")
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--context-length", type=int)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: all cores)")
    p.add_argument("--prefix-cache-tokens", type=int, default=0,
                   help="tokens of KV the prefix cache keeps for requests that start with earlier ones "
                        "(0: as many as --prefix-cache-mb holds)")
    p.add_argument("--prefix-cache-mb", type=float, default=1024,
                   help="memory for the prefix cache's KV when --prefix-cache-tokens is 0")
    p.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache (SGLang's flag)")
    p.add_argument("--tp-size", type=int, default=1, help="must be 1: the embedded engine is one device")
    p.add_argument("--kernels", default="{}",
                   help='kernel choices as JSON, e.g. {"gdn": "torch"} (rlx\'s model.kernels; unnamed ops: auto, but matmul: torch)')
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="every request's tokens independent of what else runs (SGLang's flag): one request at a time, "
                        "no prefix cache; with a sampling_seed per request, a run samples the same tokens again")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="record the experts each token is routed to, for requests with return_routed_experts")
    p.add_argument("--quantization", choices=["fp8", "int4"],
                   help="serve quantised weights, held as pushed and computed with dequantised: fp8, the FP8 "
                        "checkpoint at --model-path as stored (without this flag it is served dequantised); int4, "
                        "the model's weights quantised at start (W4A16, groups of 128)")
    p.add_argument("--speculative-algorithm", choices=["NGRAM", "STANDALONE", "EAGLE", "NEXTN"],
                   help="speculative decoding, drafts verified by rejection sampling (tokens as without, more of them "
                        "per forward): NGRAM, looked up in the request's own tokens; STANDALONE, drawn from the model "
                        "at --speculative-draft-model-path; EAGLE (or NEXTN), from the checkpoint's MTP layer")
    p.add_argument("--speculative-draft-model-path", help="STANDALONE: the draft model (the same tokenizer)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=5,
                   help="tokens a verify forward runs per request, as SGLang counts them: the last one and the drafts")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters loaded at run time (/load_lora_adapter, /load_lora_adapter_from_tensors), "
                        "named per request (lora_path), mixed in one batch (peft's LoRA layers)")
    p.add_argument("--max-lora-rank", type=int, help="refuse adapters of a larger rank (SGLang's flag)")
    p.add_argument("--lora-target-modules", nargs="+",
                   help="refuse adapters on other modules (peft's names; all: any), as SGLang's flag")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (args.speculative_algorithm == "STANDALONE") != (args.speculative_draft_model_path is not None):
        print("error: --speculative-draft-model-path names the draft of --speculative-algorithm STANDALONE, and only "
              "of it", file=sys.stderr)
        return 2
    if args.speculative_algorithm and args.speculative_num_draft_tokens < 2:
        print("error: --speculative-num-draft-tokens counts the last token and the drafts: at least 2",
              file=sys.stderr)
        return 2
    if args.tp_size != 1:
        print("error: the embedded engine runs on one device (--tp-size 1); use SGLang for TP", file=sys.stderr)
        return 2
    import torch
    from aiohttp import web
    from transformers import AutoTokenizer

    from rlx.models.load import load_lm
    from rlx.models.tiny import resolve_model_path
    from rlx.rollout.engines.embedded.scheduler import Scheduler
    from rlx.rollout.engines.embedded.server import EngineServer

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    path = resolve_model_path(args.model_path)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer_path or path))
    model = load_lm(path, getattr(torch, dtype)).to(device).eval()
    draft = None
    if args.speculative_draft_model_path:
        draft = load_lm(resolve_model_path(args.speculative_draft_model_path), getattr(torch, dtype)).to(device).eval()
    from rlx.rollout.engines.embedded.weights import name_as_checkpoint

    name_as_checkpoint(model, path)  # (pushes come by the checkpoint's names)
    if args.quantization:
        from rlx.rollout.engines.embedded.weights import serve_quantized

        serve_quantized(model, args.quantization, path)
    from rlx.rollout.engines.embedded.gdn_kernel import use_gdn_kernel

    use_gdn_kernel(model, json.loads(args.kernels).get("gdn", "auto"))
    from rlx.plugins import process_plugins
    from rlx.train.kernel_choice import matmul_choice, use_matmul

    matmul = use_matmul(process_plugins(), matmul_choice(json.loads(args.kernels)), device,
                        getattr(torch, dtype), model.config.get_text_config().hidden_size, fallback=True)
    # A forward's numbers for one row depend on the batch's shape (the matmuls' blocking): batch-invariant here means
    # a batch of one. A prefix cache would hand a prompt KV computed within another, longer one: off.
    deterministic = args.enable_deterministic_inference
    no_cache = args.disable_radix_cache or deterministic
    adapters = None
    if args.enable_lora:
        from rlx.rollout.engines.embedded.lora import Adapters

        adapters = Adapters(model, args.max_lora_rank, args.lora_target_modules)
    scheduler = Scheduler(model, tokenizer, max_running=1 if deterministic else args.max_running_requests,
                          seed=args.random_seed, max_context=args.context_length,
                          capture_experts=args.enable_return_routed_experts,
                          prefix_cache_tokens=0 if no_cache else args.prefix_cache_tokens,
                          prefix_cache_bytes=0 if no_cache else int(args.prefix_cache_mb * 2**20),
                          speculative=args.speculative_num_draft_tokens - 1 if args.speculative_algorithm else 0,
                          draft=draft, mtp=args.speculative_algorithm in ("EAGLE", "NEXTN"), adapters=adapters)
    server = EngineServer(scheduler, model_path=args.model_path, served_model_name=args.served_model_name,
                          server_args={k: v for k, v in vars(args).items()})
    scheduler.start()

    async def serve() -> None:
        runner = web.AppRunner(server.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        print(f"rlx embedded engine ready on http://{args.host}:{args.port} (pid {os.getpid()}, "
              f"{device}, {dtype}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY "
              f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, {matmul.name})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(serve())
    finally:
        scheduler.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    # everything is stopped and written: skip the interpreter's teardown, which spends about a second in native
    # code (no Python frame) after main returns, on every engine stop
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
