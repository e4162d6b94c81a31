"""The checks `tests/gpu/check.py` runs (see its docstring for the list and how they are run): each takes a `Ctx`,
records its figures with `Ctx.fig` and raises `Failed` (or lets an error out) when its pass rule does not hold."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
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
                  ("qwen3_next_gdn", "builtin://tiny-qwen3-next", "none"),
                  ("qwen3_5_published", "builtin://tiny-qwen3.5", "none"),
                  ("kimi_k25_published", "builtin://tiny-kimi-k2.5", "none"),
                  ("minimax_m2_r3", "builtin://tiny-minimax-m2", "on"),
                  ("glm5_dsa", "builtin://tiny-glm5", "none"),
                  ("deepseek_v32_dsa", "builtin://tiny-deepseek-v3.2", "none")]


def check_trainer(ctx: Ctx) -> None:
    """Pass, for each model (dense Qwen3; Qwen3-MoE, GLM-4.5 and MiniMax-M2 with rollout routing replay; DeepSeek-V3
    with latent attention; GLM-5 and DeepSeek-V3.2 with sparse attention; Qwen3-Next, whose GDN layers take the GPU
    kernel ``auto`` picks; Qwen3.5 and Kimi-K2.5 as published, vision-language wrappers): each of two GRPO steps' loss, KL and entropy within 5% (relative) of the fp32 CPU
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

    from rlx.rollout.engines.client import GenerateRequest
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
    GPU) leaves every engine tensor equal bit for bit to what was sent (``weight_sync.verify: full``), and the
    engine's log-probs then match the trained trainer's as in the engine check."""
    from rlx.plugins import build_plugins
    from rlx.orchestrate.ranks import weight_target
    from rlx.transport.sender import WeightSender
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    with engine_and_trainer(ctx) as (fleet, trainer):
        groups = [Group(i, [Sample([5, 6, 7], [8 + i, 9, 10 + j], [1, 1, 1], [-6.0] * 3, reward=float(j),
                                   status=SampleStatus.COMPLETED, sample_id=4 * i + j, group_id=i)
                            for j in range(4)]) for i in range(2)]
        trainer.train_step(RolloutBatch(1, groups))
        sender = WeightSender(trainer, build_plugins(), trainer.cfg.weight_sync.transport, "full", 1,
                              engine_for=lambda url: weight_target(url, 600))
        sender.setup([e.url for e in fleet.engines], str(ctx.work), "127.0.0.1")
        t = time.monotonic()
        sender.push(1)  # raises if any tensor differs
        took = time.monotonic() - t
        sender.close()
        mean, worst, _ = sample_and_compare(fleet, trainer)
    ctx.fig(push_verified_s=took, mean_abs_logprob_diff_after=mean, max_abs_logprob_diff_after=worst)
    ctx.expect(mean < 0.05, f"after the push, mean |log-prob difference| {mean:.4f}")


def check_speculative(ctx: Ctx) -> None:
    """Pass: the embedded engine's scheduler on the device (bf16 on a GPU), 16 rows of repetitive prompts, 48 greedy
    tokens each: with n-gram drafts and with a draft model equal to the target, each token's log-prob is within 0.05
    of a full forward's, the draft model's drafts pass at least 90% of the time (the two compute p and q with
    other kernels, so not always), and the tokens differ from plain decoding's in under a tenth of rows (a bf16
    near-tie can flip under another batch shape). Figures: tokens/s of each, acceptance."""
    import copy

    import torch
    from transformers import AutoTokenizer

    from rlx.models.load import load_lm
    from rlx.models.tiny import resolve_model_path
    from rlx.rollout.engines.embedded.sampling import SamplingParams
    from rlx.testing.runs import decode

    path = resolve_model_path(DENSE)
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    model = load_lm(path, dtype).to(ctx.device).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [[5 + i, 6, 7, 8] * 6 for i in range(16)]
    params = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)

    def run(**spec: Any) -> tuple[list[Any], Any, float]:
        reqs, s, took = decode(model, tok, prompts, params, max_running=16, **spec)
        return reqs, s, sum(len(r.output_ids) for r in reqs) / took

    plain, _, plain_rate = run()
    ngram, s_ngram, ngram_rate = run(speculative=4)
    drafted, s_draft, draft_rate = run(speculative=4, draft=copy.deepcopy(model))
    worst = 0.0
    for r in ngram + drafted:
        ids = torch.tensor([r.input_ids + r.output_ids], device=ctx.device)
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        want = lp[len(r.input_ids) - 1:-1].gather(1, ids[0, len(r.input_ids):, None])[:, 0].cpu()
        worst = max(worst, float((want - torch.tensor(r.logprobs)).abs().max()))
    flipped = sum(a.output_ids != b.output_ids for a, b in zip(plain, ngram, strict=True))
    accept = s_draft.spec_correct / max(s_draft.spec_proposed, 1)
    ctx.fig(plain_tokens_per_s=plain_rate, ngram_tokens_per_s=ngram_rate, draft_tokens_per_s=draft_rate,
            ngram_accept=s_ngram.spec_correct / max(s_ngram.spec_proposed, 1), draft_accept=accept,
            max_logprob_diff=worst, rows_differing=flipped)
    ctx.expect(worst < 0.05 and accept > 0.9 and flipped < 2, f"log-prob difference {worst:.4f}, draft acceptance "
                                                              f"{accept:.3f}, {flipped} rows differ")


# -- kernels -------------------------------------------------------------------------------------------------


def check_gdn(ctx: Ctx) -> None:
    """Pass: each GPU kernel of the GDN plugin that can run here (gdn-fla; gdn-flashqla where FlashQLA is installed,
    which the bundle is not: tilelang's wheel is 50 MB), selected as `model.kernels` selects it, on bf16 inputs
    (packed sequences of 700, 300 and 500 tokens, 4 key heads, 8 value heads, head size 128) within 2% (max error
    over max value) of the plugin's fp32 torch implementation, outputs and every input's gradient."""
    import torch

    from rlx.plugins import build_plugins
    from rlx.train.kernel_choice import candidates
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


def train_config(ctx: Ctx, name: str, steps: int, rollout: dict[str, Any] | None = None, **train: Any) -> Path:
    data = ROOT / "examples" / "data"
    cfg = {"run": {"name": name, "output_dir": str(ctx.work / name), "loggers": [], "seed": 1},
           "model": {"path": DENSE}, "ray": {"enabled": False},
           "data": {"path": str(data / "arithmetic.jsonl"), "metadata_key": "metadata"},
           "rollout": {"n_prompts": 8, "n_samples_per_prompt": 8,
                       "rewards": [{"name": "digits", "weight": 1.0}, {"name": "exact_match", "weight": 1.0}],
                       "sampling": {"temperature": 1.0, "max_new_tokens": 16},
                       "engines": [{"name": "main", "num_engines": 1, "server_args": {"device": ctx.device}}],
                       **({"offload_during_train": True} if train.get("offload") else {}), **(rollout or {})},
           "weight_sync": {"transport": "tensor"},
           "train": {"num_steps": steps, "optim": {"lr": 1.0e-3},
                     "objective": {"advantage": "grpo", "loss": "ppo_clip", "loss_norm": "token"}, **train}}
    path = ctx.work / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    return path


def check_rl_train(ctx: Ctx) -> None:
    """Pass: ``rl train`` (the quickstart's task, 10 steps (4 with --cpu), the engine on this device) exits 0 and logs every step,
    without and with colocated offload (train.offload and rollout.offload_during_train), and with FP8 rollout
    (rollout.quantization: the engine serving FP8 weights; its log-prob difference is a figure)."""
    steps = 4 if SMALL else 10
    for name, extra in (("plain", {}), ("offload", {"offload": True}), ("fp8", {"rollout": {"quantization": "fp8"}})):
        path = train_config(ctx, name, steps, **extra)
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(path)], capture_output=True,
                              text=True, timeout=170)
        took = time.monotonic() - t
        (ctx.work / f"{name}.log").write_text(proc.stdout + proc.stderr)
        ctx.expect(proc.returncode == 0, f"{name}: rl train exited {proc.returncode}: {proc.stderr[-1500:]}")
        rows = [json.loads(x) for x in (ctx.work / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
        ctx.expect(len(rows) == steps, f"{name}: {len(rows)} steps logged, not {steps}")
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
    from rlx.rollout.engines.client import GenerateRequest
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
