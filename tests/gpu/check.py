"""The GPU checks, run by ``scripts/gpu-check`` on one NVIDIA GPU (the lent machine as it is: the image's Python,
the `.whl` bundle, no Ray, no SGLang). Each check runs in a process of its own with its own time limit (a hang
costs its limit, not the GPU time of the rest), and writes its figures and its log under ``--out``; the table
of all of them is ``OUT/gpu-check.md``, ready for benchmarks/RESULTS.md.

    python tests/gpu/check.py --out DIR [--dry-run] [--cpu] [--only NAME ...]

``--dry-run`` prints the plan and why each check would be skipped here, and runs nothing (seconds, on a CPU).
``--cpu`` runs the checks that can run on a CPU there, to test the checks themselves (CI does, for some).

What is checked (the pass rule of each is in its function's docstring):

* environment: every package the checks import imports, at versions that satisfy the bundle's requirements;
* trainer: megatron in bf16 on the GPU against the fp32 CPU trainer, two GRPO steps: dense Qwen3, Qwen3-MoE,
  GLM-4.5 and MiniMax-M2 with rollout routing replay, DeepSeek-V3 (latent attention), GLM-5 and DeepSeek-V3.2
  (sparse attention), Qwen3-Next (GDN), Qwen3.5 and Kimi-K2.5 as published (vision-language wrappers);
* engine: the embedded engine on the GPU: its sampled tokens' log-probs against the trainer's forward;
* transport: a trained step pushed by the ``tensor`` transport (CUDA IPC handles) into that engine, every tensor
  verified bit for bit, then its log-probs against the trainer's again;
* gdn: flash-linear-attention's gated delta rule against rlx's fp32 torch implementation, forward and backward;
* offload: colocated offload (train.offload) on a ~0.5B model: memory held between steps and peak, with and
  without, and the same loss;
* rl-train: ``rl train`` for 10 steps on the GPU (reward, trainer/engine log-prob difference, s/step), without
  and with colocated offload;
* throughput: the embedded engine's tokens/s and a train step's MFU on a random ~0.5B model (no download);
* sglang-router, sglang-transports, sglang-offload: SGLang on the GPU, where it is installed (``pip install
  'rlx[sglang]'``; it is not in the bundle: with its CUDA kernels it is far over the size limit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the checks beside this file, also when imported
from checks import (Ctx, Failed, check_engine, check_environment, check_gdn, check_offload,  # noqa: E402
                    check_rl_train, check_speculative, check_throughput, check_trainer, check_transport)
from sglang_checks import (check_sglang_fp8, check_sglang_offload, check_sglang_router,  # noqa: E402
                           check_sglang_speculative, check_sglang_transports)


@dataclass
class Check:
    name: str
    limit_s: int
    run: Callable[[Ctx], None]
    what: str
    on_cpu: bool = False  # --cpu runs it on the CPU
    # torch.compile as megatron uses it on a GPU (jit_fuser); off where the check is about values or memory, so
    # that compile times of unknown length cannot eat its limit (TORCHDYNAMO_DISABLE, torch's own switch)
    compile: bool = False
    needs: tuple[str, ...] = ()  # modules without which it is skipped, saying so


PLAN = [  # in order of what matters most, should the budget run out
    Check("environment", 45, check_environment, "imports, and the bundle's requirements against installed versions",
          on_cpu=True),
    Check("trainer", 300, check_trainer, "megatron bf16 on the GPU vs fp32 on the CPU: dense, MoE+R3, MLA, DSA, "
                                         "GDN, published wrappers"),
    Check("engine", 50, check_engine, "embedded engine on the GPU: log-probs vs the trainer's forward", on_cpu=True),
    Check("transport", 60, check_transport, "tensor transport (CUDA IPC) into the engine, bit-exact", on_cpu=True),
    Check("rl-train", 180, check_rl_train, "rl train 10 steps on the GPU: plain, with offload, with FP8 rollout",
          on_cpu=True, compile=True),
    Check("speculative", 40, check_speculative, "embedded engine's n-gram and draft-model drafts on the GPU: "
                                                "log-probs, acceptance, tokens/s", on_cpu=True),
    Check("offload", 80, check_offload, "colocated offload: memory between steps and peak, ~0.5B model",
          on_cpu=True),
    Check("gdn", 40, check_gdn, "flash-linear-attention GDN vs fp32 torch, forward and backward", needs=("fla",)),
    Check("throughput", 90, check_throughput, "engine tokens/s, train step MFU, ~0.5B random model", on_cpu=True,
          compile=True),
    Check("sglang-router", 150, check_sglang_router, "two SGLang groups behind sglang-router",
          needs=("sgl_kernel", "sglang_router")),
    Check("sglang-transports", 240, check_sglang_transports, "tensor, broadcast (NCCL) and disk pushes into SGLang",
          needs=("sgl_kernel",)),
    Check("sglang-offload", 120, check_sglang_offload, "SGLang's memory saver releases and resumes",
          needs=("sgl_kernel",)),
    Check("sglang-fp8", 150, check_sglang_fp8, "FP8 rollout: quantised pushes into SGLang's FP8 path",
          needs=("sgl_kernel",)),
    Check("sglang-speculative", 150, check_sglang_speculative, "SGLang's n-gram speculative decoding: its counts, "
                                                                "log-probs", needs=("sgl_kernel",)),
]


# -- the runner ------------------------------------------------------------------------------------------------


def skip_reason(check: Check, cuda: bool, cpu: bool) -> str | None:
    import importlib.util

    if not cuda and not (cpu and check.on_cpu):
        return "no CUDA device here"
    for module in check.needs:
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        except (ImportError, ValueError):
            return f"{module} is not installed"
    return None


def run_one(name: str, out: Path, device: str) -> None:
    """In the child: run one check, write ``OUT/<name>.json`` (status, figures, why)."""
    check = next(c for c in PLAN if c.name == name)
    ctx = Ctx(device, out / "work" / name)
    ctx.work.mkdir(parents=True, exist_ok=True)
    status, why = "pass", ""
    try:
        check.run(ctx)
    except Failed as e:
        status, why = "FAIL", str(e)
    except Exception as e:  # noqa: BLE001 - the check's finding; the traceback is in its log
        traceback.print_exc()
        status, why = "ERROR", f"{type(e).__name__}: {e}"
    (out / f"{name}.json").write_text(json.dumps({"status": status, "why": why, "figures": ctx.figures}))


def device_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__})"
    p = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip() or "?"
    return (f"{p.name}, {p.total_memory / 2**30:.0f} GiB, driver {smi}; torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}; Python {sys.version.split()[0]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the table, each check's figures and logs")
    p.add_argument("--dry-run", action="store_true", help="print the plan and what would be skipped; run nothing")
    p.add_argument("--cpu", action="store_true", help="run the checks that can run on a CPU, there")
    p.add_argument("--only", nargs="+", metavar="NAME", help="these checks only")
    p.add_argument("--budget", type=float, default=480,
                   help="seconds: a check that could end past this (its limit) is not started (default 480)")
    p.add_argument("--run", help=argparse.SUPPRESS)  # in the child: run this one check
    args = p.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        os.environ["RLX_GPU_CHECK_SMALL"] = "1"  # for the children
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.run:
        run_one(args.run, out, device)
        return 0
    unknown = set(args.only or []) - {c.name for c in PLAN}
    if unknown:
        p.error(f"no check named {sorted(unknown)}; the checks: {[c.name for c in PLAN]}")
    plan = [c for c in PLAN if not args.only or c.name in args.only]
    mode = " --dry-run: nothing ran" if args.dry_run else (" --cpu" if args.cpu else "")
    head = (f"## GPU check ({time.strftime('%Y-%m-%d', time.gmtime())}, scripts/gpu-check{mode})\n\n"
            f"Device: {device_line()}. Limits sum to {sum(c.limit_s for c in plan)} s; checks that could end past "
            f"{args.budget:.0f} s are not started.\n\n"
            "| check | what | limit s | result | s | figures |\n|---|---|---|---|---|---|\n")
    print(head, end="", flush=True)
    rows, failed, start = [], 0, time.monotonic()
    (out / "logs").mkdir(exist_ok=True)
    for check in plan:
        # a dry run shows what a GPU would run: only a missing package skips a check there
        reason = skip_reason(check, cuda or args.dry_run, args.cpu)
        took, figures = 0.0, {}
        if reason:
            result = f"skipped: {reason}"
        elif args.dry_run:
            result = "would run"
        elif time.monotonic() - start + check.limit_s > args.budget:
            result = f"skipped: could end past the budget of {args.budget:.0f} s"
        else:
            t = time.monotonic()
            result, figures = run_child(check, out)
            took = time.monotonic() - t
            failed += not result.startswith("pass")
        rows.append(f"| {check.name} | {check.what} | {check.limit_s} | {result} | {took:.0f} | "
                    + ", ".join(f"{k} {v}" for k, v in figures.items()) + " |")
        print(rows[-1], flush=True)
        (out / "gpu-check.md").write_text(head + "\n".join(rows) + "\n")  # kept should the run be cut off
    print(f"\n{len(plan)} checks, {failed} failed, {time.monotonic() - start:.0f} s; table in "
          f"{out / 'gpu-check.md'}, logs in {out / 'logs'}")
    return 1 if failed else 0


def run_child(check: Check, out: Path) -> tuple[str, dict[str, Any]]:
    """Run `check` in a process group of its own, killed whole at its time limit."""
    result_file = out / f"{check.name}.json"
    result_file.unlink(missing_ok=True)
    with open(out / "logs" / f"{check.name}.log", "w") as log:
        env = {**os.environ, **({} if check.compile else {"TORCHDYNAMO_DISABLE": "1"})}
        proc = subprocess.Popen([sys.executable, __file__, "--out", str(out), "--run", check.name], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            proc.wait(timeout=check.limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"FAIL: over its limit of {check.limit_s} s (killed)", {}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # what the check started and left behind
    if not result_file.exists():
        return f"ERROR: exited {proc.returncode} without a result (see logs/{check.name}.log)", {}
    r = json.loads(result_file.read_text())
    return (r["status"].lower() if r["status"] == "pass" else f"{r['status']}: {r['why'][:300]}"), r["figures"]


if __name__ == "__main__":
    sys.exit(main())
