"""The GPU checks, run by ``scripts/gpu-check`` on one NVIDIA GPU (the lent machine as it is: the image's Python,
the `.whl` bundle, no Ray, no SGLang). Each check runs in a process of its own with its own time limit (a hang
costs its limit, not the GPU time of the rest), and writes its figures and its log under ``--out``; the table
of all of them is ``OUT/gpu-check.md``, ready for benchmarks/RESULTS.md.

    python tests/gpu/check.py --out DIR [--dry-run] [--cpu] [--only NAME ...]

``--dry-run`` prints the plan and why each check would be skipped here, and runs nothing (seconds, on a CPU).
``--cpu`` runs the checks that can run on a CPU there, to test the checks themselves (CI does, for some).

What is checked (the pass rule of each is in its function's docstring):

* environment: every package the checks import imports, at versions that satisfy the bundle's requirements;
* trainer: megatron in bf16 on the GPU against the fp32 CPU trainer, two GRPO steps: dense Qwen3, Qwen3-MoE and
  GLM-4.5 with rollout routing replay, DeepSeek-V3 (latent attention), Qwen3-Next (GDN);
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DENSE, MOE = "builtin://tiny-qwen3", "builtin://tiny-qwen3-moe"
# bf16 dense peak of the GPUs this project is lent, from NVIDIA's datasheets (SXM); MFU is against it
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}
PEER_MFU = "Megatron-LM (NVIDIA's README): up to 47% MFU, GPT-3 175B on H100 clusters (TP4 PP8)"


class Failed(Exception):
    """A check's expectation that did not hold (its figures are kept)."""


@dataclass
class Ctx:
    device: str  # "cuda" or "cpu" (--cpu)
    work: Path  # this check's scratch folder
    figures: dict[str, Any] = field(default_factory=dict)

    def fig(self, **figures: Any) -> None:
        self.figures.update({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in figures.items()})

    def expect(self, ok: bool, why: str) -> None:
        if not ok:
            raise Failed(why)


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


def run_async(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)


# -- environment ---------------------------------------------------------------------------------------------


def check_environment(ctx: Ctx) -> None:
    """Pass: every module the checks import imports, and every requirement of rlx (as scripts/gpu-bundle reads them)
    and of each bundle wheel is installed at a version that satisfies it: the image's versions its package list
    does not record, which tests/test_gpu_bundle.py assumes, checked on the machine."""
    import importlib
    import importlib.metadata as md

    import torch

    ctx.fig(torch=torch.__version__, cuda=torch.version.cuda or "-",
            gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
    broken = []
    for module in ("pydantic", "megatron.core", "transformers", "rlx", "rlx_cli.main", "rlx_model_qwen",
                   "rlx_model_glm", "rlx_model_deepseek", "rlx_kernel_flashqla", "tensorboardX"):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - reported as the check's finding
            broken.append(f"{module}: {type(e).__name__}: {e}")
    for dist in ("megatron-core", "transformers", "flash-linear-attention"):
        with contextlib.suppress(md.PackageNotFoundError):
            ctx.fig(**{dist: md.version(dist)})
    # rlx's declared requirements and each bundle wheel's, evaluated for this machine as the bundle was made for it
    from importlib.machinery import SourceFileLoader
    from importlib.util import module_from_spec, spec_from_loader

    spec = spec_from_loader("gpu_bundle", SourceFileLoader("gpu_bundle", str(ROOT / "scripts" / "gpu-bundle")))
    bundle = module_from_spec(spec)
    spec.loader.exec_module(bundle)
    wheels = sorted(bundle.BUNDLE.glob("*.whl"))
    reqs = [("rlx", r) for r in bundle.declared()]
    reqs += [(bundle.wheel_name(w), r) for w in wheels for r in bundle.wheel_requirements(w)]
    conflicts, absent = [], []
    for by, req in reqs:
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            absent.append(req.name)
            continue
        if not req.specifier.contains(have, prereleases=True):
            conflicts.append(f"{by} needs {req.name}{req.specifier}: {have} is installed")
    ctx.fig(bundle_wheels=len(wheels), not_installed=sorted(set(absent)) or "none")
    ctx.expect(not broken, "; ".join(broken))
    ctx.expect(not absent or ctx.device == "cpu", f"not installed: {sorted(set(absent))}")  # --cpu: this venv
    ctx.expect(not conflicts, "; ".join(conflicts))


# -- trainer: bf16 on the GPU against fp32 on the CPU ----------------------------------------------------------


TRAINER_MODELS = [("dense", DENSE, "none"), ("qwen3_moe_r3", MOE, "on"), ("glm4_moe_r3", "builtin://tiny-glm4-moe", "on"),
                  ("deepseek_v3_mla", "builtin://tiny-deepseek-v3", "none"),
                  ("qwen3_next_gdn", "builtin://tiny-qwen3-next", "none")]


def check_trainer(ctx: Ctx) -> None:
    """Pass, for each model (dense Qwen3; Qwen3-MoE and GLM-4.5 with rollout routing replay; DeepSeek-V3 with
    latent attention; Qwen3-Next, whose GDN layers take the GPU kernel ``auto`` picks): each of two GRPO steps' loss, KL and entropy within 5% (relative) of the fp32 CPU
    trainer's, and with replay every token routed as the engine routed it (agreement 1). A model that fails
    does not stop the others."""
    from rlx.testing.parallel import run

    failures = []
    for name, model, replay in TRAINER_MODELS:
        try:
            for side in ("gpu", "cpu"):
                (ctx.work / f"{name}-{side}").mkdir(exist_ok=True)
            t = time.monotonic()
            here = run(ctx.work / f"{name}-gpu", model, 1, replay=replay, timeout_s=240)
            took = time.monotonic() - t
            cpu = run(ctx.work / f"{name}-cpu", model, 1, replay=replay, timeout_s=240,
                      env={"CUDA_VISIBLE_DEVICES": ""})
        except Exception as e:  # noqa: BLE001 - the model's finding; the others still run
            print(f"{name}: {e}", flush=True)
            failures.append(f"{name}: {str(e).strip().splitlines()[-1][:200]}")
            continue
        worst = max(abs(here[step][key] - cpu[step][key]) / max(abs(cpu[step][key]), 1e-3)
                    for step in ("m1", "m2") for key in ("loss", "kl", "entropy"))
        weights = max(max(abs(x - y) for x, y in zip(here["weights"][n], w, strict=True))
                      for n, w in cpu["weights"].items())
        ctx.fig(**{f"{name}_worst_rel_diff": worst, f"{name}_weights_max_abs_diff": weights,
                   f"{name}_gpu_run_s": took})
        if worst >= 0.05:
            failures.append(f"{name}: loss/KL/entropy differ from fp32 CPU by {worst:.3f} (relative)")
        if replay == "on":
            agreement = here["m1"]["moe/routing_agreement"]
            ctx.fig(**{f"{name}_routing_agreement": agreement})
            if agreement != 1.0:
                failures.append(f"{name}: routing replay agreement {agreement}, not 1")
    ctx.expect(not failures, "; ".join(failures))


# -- the embedded engine and the tensor transport on the GPU ---------------------------------------------------


@contextlib.contextmanager
def engine_and_trainer(ctx: Ctx, model: str = DENSE) -> Iterator[tuple[Any, Any]]:
    """One embedded engine on this device (launched as `rl train` launches it) and a one-rank trainer beside it."""
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.rollout.engines.fleet import EngineFleet
    from rlx.train.trainer import Trainer

    cfg = parse_config(json.dumps({"model": {"path": model}, "ray": {"enabled": False},
                                   "run": {"output_dir": str(ctx.work / "run")},
                                   "rollout": {"engines": [{"backend": "embedded",
                                                            "server_args": {"device": ctx.device}}]}}))
    fleet = EngineFleet(cfg, ctx.work / "logs")
    run_async(fleet.start())
    try:
        yield fleet, Trainer(cfg, build_plugins())
    finally:
        run_async(fleet.stop())


def sample_and_compare(fleet: Any, trainer: Any, n: int = 16, tokens: int = 24) -> tuple[float, float, float]:
    """`n` sampled continuations; (mean, max) |engine - trainer| log-prob over their tokens, and tokens/s."""
    import asyncio

    import torch

    from rlx.rollout.engines.protocol import GenerateRequest
    from rlx.types import Sample, SampleStatus

    async def go():
        async with fleet.client() as c:
            t = time.monotonic()
            outs = await asyncio.gather(*(c.generate(GenerateRequest(
                [5, 6, 7 + i, 9 + 3 * i], {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}))
                for i in range(n)))
            return [r for (r,) in outs], time.monotonic() - t

    outs, took = run_async(go())
    samples = [Sample([5, 6, 7 + i, 9 + 3 * i], list(r.output_ids), [1] * len(r.output_ids),
                      list(r.output_logprobs), status=SampleStatus.COMPLETED, sample_id=i, group_id=i)
               for i, r in enumerate(outs)]
    ours = trainer.step_fn.logprobs(trainer.actor, samples)
    diff = torch.cat([(ours[s.sample_id].float() - torch.tensor(s.rollout_logprobs)).abs() for s in samples])
    return float(diff.mean()), float(diff.max()), sum(len(s.response_ids) for s in samples) / took


def check_engine(ctx: Ctx) -> None:
    """Pass: the mean |log-prob| difference between the engine's sampled tokens and the trainer's forward of the
    same tokens is under 0.05 (both bf16 on a GPU; fp32 on a CPU)."""
    with engine_and_trainer(ctx) as (fleet, trainer):
        mean, worst, rate = sample_and_compare(fleet, trainer)
    ctx.fig(mean_abs_logprob_diff=mean, max_abs_logprob_diff=worst, tokens_per_s=rate)
    ctx.expect(mean < 0.05, f"mean |log-prob difference| {mean:.4f}")


def check_transport(ctx: Ctx) -> None:
    """Pass: after one training step, the ``tensor`` transport's push (CUDA IPC handles to an engine on the same
    GPU) leaves every engine tensor equal bit for bit to what was sent (``verify_weights: full``), and the
    engine's log-probs then match the trained trainer's as in the engine check."""
    from rlx.plugins import build_plugins
    from rlx.orchestrate.workers import weight_target
    from rlx.transport.sender import WeightSender
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    with engine_and_trainer(ctx) as (fleet, trainer):
        groups = [Group(i, [Sample([5, 6, 7], [8 + i, 9, 10 + j], [1, 1, 1], [-6.0] * 3, reward=float(j),
                                   status=SampleStatus.COMPLETED, sample_id=4 * i + j, group_id=i)
                            for j in range(4)]) for i in range(2)]
        trainer.train_step(RolloutBatch(1, groups))
        sender = WeightSender(trainer, build_plugins(), trainer.cfg.train.transport, "full", 1,
                              engine_for=lambda url: weight_target(url, 600))
        sender.setup([e.url for e in fleet.engines], str(ctx.work), "127.0.0.1")
        t = time.monotonic()
        sender.push(1)  # raises if any tensor differs
        took = time.monotonic() - t
        sender.close()
        mean, worst, _ = sample_and_compare(fleet, trainer)
    ctx.fig(push_verified_s=took, mean_abs_logprob_diff_after=mean, max_abs_logprob_diff_after=worst)
    ctx.expect(mean < 0.05, f"after the push, mean |log-prob difference| {mean:.4f}")


# -- kernels -------------------------------------------------------------------------------------------------


def check_gdn(ctx: Ctx) -> None:
    """Pass: each GPU kernel of the GDN plugin that can run here (gdn-fla; gdn-flashqla where FlashQLA is installed,
    which the bundle is not: tilelang's wheel is 50 MB), selected as `model.kernels` selects it, on bf16 inputs
    (packed sequences of 700, 300 and 500 tokens, 4 key heads, 8 value heads, head size 128) within 2% (max error
    over max value) of the plugin's fp32 torch implementation, outputs and every input's gradient."""
    import torch

    from rlx.plugins import build_plugins
    from rlx.train.kernels import candidates
    from rlx_kernel_flashqla.torch_gdn import chunk_gated_delta_rule as torch_gdn

    g = torch.Generator(device="cuda").manual_seed(0)
    t, h, hv, d = 1500, 4, 8, 128
    cu = torch.tensor([0, 700, 1000, 1500], device="cuda", dtype=torch.long)
    base = [torch.randn(1, t, h, d, device="cuda", generator=g), torch.randn(1, t, h, d, device="cuda", generator=g),
            torch.randn(1, t, hv, d, device="cuda", generator=g),
            -torch.rand(1, t, hv, device="cuda", generator=g) * 0.5, torch.rand(1, t, hv, device="cuda", generator=g)]

    def inputs(dtype):  # the same values in each dtype (bf16 rounded once, the reference computes in fp32)
        return [x.to(torch.bfloat16).to(dtype).requires_grad_() for x in base]

    def go(fn, xs):
        o, state = fn(*xs, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True)
        w = torch.randn(o.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
        ((o.float() * w).sum() + state.float().sum()).backward()
        return [o.detach().float(), state.detach().float(), *(x.grad.float() for x in xs)]

    torch.cuda.synchronize()
    t0 = time.monotonic()
    ref = go(torch_gdn, inputs(torch.float32))
    torch.cuda.synchronize()
    ctx.fig(torch_fp32_fwd_bwd_s=time.monotonic() - t0)
    names = ["output", "final_state", "dq", "dk", "dv", "dg", "dbeta"]
    ran = []
    for kernel in candidates(build_plugins(), "gdn"):
        if kernel.name == "gdn-torch":
            continue
        reason = kernel.supports(device="cuda", dtype=torch.bfloat16)
        if reason is not None:
            ctx.fig(**{kernel.name: f"skipped: {reason}"})
            continue
        torch.cuda.synchronize()
        t0 = time.monotonic()
        got = go(kernel, inputs(torch.bfloat16))
        torch.cuda.synchronize()
        errors = {n: float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for n, a, b in zip(names, got, ref)}
        ctx.fig(**{f"{kernel.name}_{n}_rel_err": e for n, e in errors.items()},
                **{f"{kernel.name}_fwd_bwd_s": time.monotonic() - t0})
        bad = {n: e for n, e in errors.items() if e > 0.02}
        ctx.expect(not bad, f"{kernel.name}: relative errors over 2%: {bad}")
        ran.append(kernel.name)
    ctx.expect(bool(ran), "no GPU kernel of the GDN plugin could run")


# -- memory: colocated offload ---------------------------------------------------------------------------------

OFFLOAD = """
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from rlx.config import parse_config
from rlx.plugins import build_plugins
from rlx.train.offload import Residency
from rlx.train.trainer import Trainer
from rlx.types import Group, RolloutBatch, Sample, SampleStatus

model, offload, out, length = sys.argv[1], sys.argv[2] == "on", sys.argv[3], int(sys.argv[4])
cuda = torch.cuda.is_available()
if not cuda:  # --cpu: host memory to host memory, to test this check's code
    Residency.MOVES = ("cuda", "cpu")
cfg = parse_config(json.dumps({"model": {"path": model}, "ray": {"enabled": False},
                               "train": {"offload": offload, "optim": {"lr": 1e-5}}}))
trainer = Trainer(cfg, build_plugins())
gib = lambda b: b / 2**30
at_start = trainer.memory.held_bytes()
g = torch.Generator().manual_seed(0)
groups = [Group(i, [Sample(torch.randint(3, 500, (length // 8,), generator=g).tolist(),
                           torch.randint(3, 500, (length - length // 8,), generator=g).tolist(),
                           [1] * (length - length // 8), [-6.0] * (length - length // 8), reward=float(j % 2),
                           status=SampleStatus.COMPLETED, sample_id=4 * i + j, group_id=i)
                    for j in range(4)]) for i in range(4)]
if cuda:
    torch.cuda.reset_peak_memory_stats()
t = time.monotonic()
m1 = trainer.train_step(RolloutBatch(1, groups))
step_s = time.monotonic() - t
between = trainer.memory.held_bytes()
m2 = trainer.train_step(RolloutBatch(2, groups))
peak = torch.cuda.max_memory_allocated() if cuda else 0
json.dump({"held_at_start_gib": gib(at_start), "held_between_steps_gib": gib(between), "peak_gib": gib(peak),
           "step_s": step_s, "moved_gib": gib(trainer.memory.moved_bytes), "loss": [m1["loss"], m2["loss"]]},
          open(out, "w"))
"""
# --cpu (RLX_GPU_CHECK_SMALL=1 too): a small model and batch, so that the CPU runs the same code in seconds
SMALL = os.environ.get("RLX_GPU_CHECK_SMALL") == "1"


def random_model(ctx: Ctx) -> str:
    """A random Qwen3 of ~0.5B parameters (32 layers, hidden 1024, the built-in 512-token vocabulary), written once
    under the run's work folder."""
    folder = ctx.work.parent / ("qwen3-small-random" if SMALL else "qwen3-0.5b-random")
    if (folder / "config.json").exists():
        return str(folder)
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlx.models.tiny import resolve_model_path

    tiny = Path(resolve_model_path(DENSE))
    config = AutoConfig.from_pretrained(tiny)
    layers = 2 if SMALL else 32  # the built-in tokenizer's vocabulary: the engine detokenizes what it samples
    config.update({"hidden_size": 128 if SMALL else 1024, "num_hidden_layers": layers, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 256 if SMALL else 3072,
                   "tie_word_embeddings": False, "layer_types": ["full_attention"] * layers,
                   "max_position_embeddings": 4096})
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init is slow on a CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = folder.with_suffix(".tmp")
    model.save_pretrained(tmp)
    for f in tiny.iterdir():
        if "token" in f.name:
            shutil.copy(f, tmp / f.name)
    tmp.rename(folder)
    return str(folder)


def check_offload(ctx: Ctx) -> None:
    """Pass: with train.offload the trainer holds no device storage between steps (when the engines generate),
    and both steps' losses equal those without offload. Peak: torch's allocator's, over the two steps."""
    model = random_model(ctx)
    got = {}
    for mode in ("off", "on"):
        script = ctx.work / "offload.py"
        script.write_text(OFFLOAD)
        out = ctx.work / f"offload-{mode}.json"
        subprocess.run([sys.executable, str(script), model, mode, str(out), str(64 if SMALL else 512)], check=True,
                       timeout=200)
        got[mode] = json.loads(out.read_text())
    off, on = got["off"], got["on"]
    ctx.fig(held_between_steps_gib_without=off["held_between_steps_gib"],
            held_between_steps_gib_with=on["held_between_steps_gib"], peak_gib_without=off["peak_gib"],
            peak_gib_with=on["peak_gib"], step_s_without=off["step_s"], step_s_with=on["step_s"],
            moved_gib=on["moved_gib"])
    ctx.expect(on["held_between_steps_gib"] == 0 < off["held_between_steps_gib"],
               "the trainer kept memory between steps with train.offload")
    ctx.expect(on["loss"] == off["loss"], f"losses differ with offload: {on['loss']} vs {off['loss']}")


# -- rl train --------------------------------------------------------------------------------------------------


def train_config(ctx: Ctx, name: str, steps: int, **train: Any) -> Path:
    data = ROOT / "examples" / "data"
    cfg = {"run": {"name": name, "output_dir": str(ctx.work / name), "loggers": [], "seed": 1},
           "model": {"path": DENSE}, "ray": {"enabled": False},
           "data": {"path": str(data / "arithmetic.jsonl"), "metadata_key": "metadata"},
           "rollout": {"n_prompts": 8, "n_samples_per_prompt": 8,
                       "rewards": [{"name": "digits", "weight": 1.0}, {"name": "exact_match", "weight": 1.0}],
                       "sampling": {"temperature": 1.0, "max_new_tokens": 16},
                       "engines": [{"name": "main", "num_engines": 1, "server_args": {"device": ctx.device}}],
                       **({"offload_during_train": True} if train.get("offload") else {})},
           "train": {"num_steps": steps, "transport": "tensor", "optim": {"lr": 1.0e-3},
                     "objective": {"advantage": "grpo", "loss": "ppo_clip", "loss_norm": "token"}, **train}}
    path = ctx.work / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    return path


def check_rl_train(ctx: Ctx) -> None:
    """Pass: ``rl train`` (the quickstart's task, 10 steps, the engine on this device) exits 0 and logs every step,
    without and with colocated offload (train.offload and rollout.offload_during_train)."""
    for name, extra in (("plain", {}), ("offload", {"offload": True})):
        path = train_config(ctx, name, 10, **extra)
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(path)], capture_output=True,
                              text=True, timeout=170)
        took = time.monotonic() - t
        (ctx.work / f"{name}.log").write_text(proc.stdout + proc.stderr)
        ctx.expect(proc.returncode == 0, f"{name}: rl train exited {proc.returncode}: {proc.stderr[-1500:]}")
        rows = [json.loads(x) for x in (ctx.work / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
        ctx.expect(len(rows) == 10, f"{name}: {len(rows)} steps logged, not 10")
        first, last = (sum(r["reward/mean"] for r in part) / len(part) for part in (rows[:3], rows[-3:]))
        diff = sum(r.get("train_rollout_logprob_diff", 0.0) for r in rows) / len(rows)
        ctx.fig(**{f"{name}_reward_first3": first, f"{name}_reward_last3": last, f"{name}_logprob_diff": diff,
                   f"{name}_s_per_step": sum(r["time/step_s"] for r in rows[1:]) / (len(rows) - 1),
                   f"{name}_wall_s": took})


# -- throughput ------------------------------------------------------------------------------------------------


def check_throughput(ctx: Ctx) -> None:
    """Figures, pass when they are produced: the embedded engine's decode tokens/s at 1 and 32 concurrent
    requests, and a train step's tokens/s and MFU (6 x parameters x tokens plus attention, against the GPU's bf16
    dense peak) on a random ~0.5B model, beside Megatron-LM's published MFU (a 175B model on 128+ GPUs: not the
    same workload; a ~0.5B model on one GPU cannot reach it)."""
    import asyncio

    import torch

    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.rollout.engines.fleet import EngineFleet
    from rlx.rollout.engines.protocol import GenerateRequest
    from rlx.train.trainer import Trainer
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    model = random_model(ctx)
    cfg = parse_config(json.dumps({"model": {"path": model}, "ray": {"enabled": False},
                                   "run": {"output_dir": str(ctx.work / "run")},
                                   "train": {"max_tokens_per_micro_batch": 8192, "optim": {"lr": 1e-5}},
                                   "rollout": {"engines": [{"backend": "embedded"}]}}))
    fleet = EngineFleet(cfg, ctx.work / "logs")
    run_async(fleet.start())
    try:
        for n in (1, 32):
            async def go(n=n):
                async with fleet.client() as c:
                    t = time.monotonic()
                    outs = await asyncio.gather(*(c.generate(GenerateRequest(
                        [5 + i, 6, 7], {"max_new_tokens": 16 if SMALL else 128, "ignore_eos": True}))
                        for i in range(n)))
                    return sum(len(r.output_ids) for (r,) in outs) / (time.monotonic() - t)

            ctx.fig(**{f"engine_tokens_per_s_{n}": run_async(go())})
    finally:
        run_async(fleet.stop())
    trainer = Trainer(cfg, build_plugins())
    g = torch.Generator().manual_seed(0)
    length, prompt = (64, 8) if SMALL else (1024, 128)

    def batch(step):
        return RolloutBatch(step, [Group(i, [Sample(torch.randint(3, 500, (prompt,), generator=g).tolist(),
                                                    torch.randint(3, 500, (length - prompt,), generator=g).tolist(),
                                                    [1] * (length - prompt), [-6.0] * (length - prompt),
                                                    reward=float(j % 2), status=SampleStatus.COMPLETED,
                                                    sample_id=8 * i + j, group_id=i) for j in range(8)])
                                   for i in range(4)])

    t = time.monotonic()
    trainer.train_step(batch(1))  # warm-up, and megatron's torch.compile of its fused functions
    ctx.fig(first_step_s=time.monotonic() - t)
    t = time.monotonic()
    for step in (2, 3):
        trainer.train_step(batch(step))  # returns metrics read from the device: synchronised
    step_s = (time.monotonic() - t) / 2
    spec = trainer.spec
    params = sum(p.numel() for n, p in trainer.actor.model.named_parameters() if "embedding" not in n)
    tokens = 32 * length
    flops = 6 * params * tokens + 6 * spec.num_layers * spec.hidden_size * length * tokens  # causal attention
    tflops = flops / step_s / 1e12
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    ctx.fig(train_tokens_per_s=tokens / step_s, train_step_s=step_s, model_tflops=tflops,
            mfu=tflops / peak if peak else "unknown GPU peak", peer=PEER_MFU)


# -- SGLang on the GPU (where it is installed: not in the bundle, so skipped on the lent machine) -------------------


def sglang_fleet(ctx: Ctx, groups: list[dict[str, Any]], **rollout: Any) -> Any:
    from rlx.config import parse_config
    from rlx.rollout.engines.fleet import EngineFleet

    cfg = parse_config(json.dumps({"model": {"path": DENSE}, "ray": {"enabled": False},
                                   "rollout": {"engines": groups, "startup_timeout_s": 600, **rollout}}))
    return EngineFleet(cfg, ctx.work / "logs")


def check_sglang_router(ctx: Ctx) -> None:
    """Pass: two SGLang groups launched from a topology behind sglang-router serve 64 requests of 32 tokens, each
    with a log-prob per token."""
    import asyncio

    from rlx.rollout.engines.protocol import GenerateRequest

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
    from rlx.rollout.engines.protocol import GenerateRequest
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


PLAN = [  # in order of what matters most, should the budget run out
    Check("environment", 45, check_environment, "imports, and the bundle's requirements against installed versions",
          on_cpu=True),
    Check("trainer", 180, check_trainer, "megatron bf16 on the GPU vs fp32 on the CPU: dense, MoE+R3, MLA, GDN"),
    Check("engine", 50, check_engine, "embedded engine on the GPU: log-probs vs the trainer's forward", on_cpu=True),
    Check("transport", 60, check_transport, "tensor transport (CUDA IPC) into the engine, bit-exact", on_cpu=True),
    Check("rl-train", 120, check_rl_train, "rl train 10 steps on the GPU, without and with offload", on_cpu=True,
          compile=True),
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
