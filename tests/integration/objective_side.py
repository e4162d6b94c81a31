"""One GRPO batch through rlx's trainer, a float64 reference of the objective, and TRL's GRPO loss; run as a
subprocess by test_objective_reference.py (megatron's CPU shim changes torch globally).

    python objective_side.py MODEL_DIR OUT.json

The batch has ragged prompts and responses, groups of 4, 3 and 2 samples (one of equal rewards: zero
advantages, tokens still counted), a truncated sample, a sample with tool tokens (loss mask 0 inside) and one
with no loss-masked token at all. rlx trains on it in micro-batches of at most 48 tokens, so the loss is summed
over many micro-batches.

The reference is the objective written out from the papers in float64 over the HF model: GRPO advantages
(Shao et al. 2024) ``(r - mean) / (std + 1e-6)`` with the population std; PPO-clip with the ratio 1 at the first
update, so the gradient is ``-sum_i sum_t m_it A_i grad log p_it / sum m`` (DAPO's token-level normalisation, Yu
et al. 2025); then the global gradient-norm clip and one Adam step.

HF's embedding layer zeroes the gradient of the row of ``pad_token_id`` (``nn.Embedding(padding_idx=...)``), a
token that may also be a real one (SmolLM2's pad is its ``<|im_end|>``). The objective's gradient has that row;
the reference and TRL's model are given no padding index so that all three compute the same objective.

Writes {"loss": {...}, "grads": {name: [rel err rlx, rel err trl]}, "update": ..., "advantages": ...}.
"""

from __future__ import annotations

import json
import random
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

LR, CLIP, MICRO_BATCH = 1e-3, 0.05, 48


def batch(vocab: int):
    from rlx.types import Group, Sample, SampleStatus

    rng = random.Random(0)
    groups, sid = [], 0
    # (reward, response length, loss mask or None for all ones, status) per sample, per group
    plan = [
        [(1.0, 5, None, "completed"), (0.0, 17, None, "completed"), (0.0, 9, None, "completed"),
         (1.0, 30, None, "truncated")],
        [(0.2, 7, [1, 1, 0, 0, 0, 1, 1], "completed"), (0.9, 12, None, "completed"), (0.5, 3, [0, 0, 0], "completed")],
        [(0.0, 11, None, "completed"), (0.0, 4, None, "completed")],
    ]
    for gid, members in enumerate(plan):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(3, 14))]
        samples = []
        for i, (reward, n, mask, status) in enumerate(members):
            samples.append(Sample(prompt_ids=prompt, response_ids=[rng.randrange(1, vocab) for _ in range(n)],
                                  loss_mask=mask or [1] * n, rollout_logprobs=None, reward=reward,
                                  status=SampleStatus(status), group_id=gid, sample_id=sid, index=i))
            sid += 1
        groups.append(Group(gid, samples, gid))
    return groups


def reference_advantages(groups) -> dict[int, float]:
    out = {}
    for g in groups:
        r = torch.tensor([s.reward for s in g.samples], dtype=torch.float64)
        a = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
        out.update({s.sample_id: float(x) for s, x in zip(g.samples, a, strict=True)})
    return out


def reference(model_dir: str, samples, adv):
    """Loss and gradient of the objective in float64, sample by sample."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.get_input_embeddings().padding_idx = None
    n = sum(sum(s.loss_mask) for s in samples)
    total = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1]
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        m = torch.tensor(s.loss_mask, dtype=torch.float64)
        loss = -(m * adv[s.sample_id] * torch.exp(lp - lp.detach())).sum() / n
        loss.backward()
        total += float(loss.detach())
    return total, {k: p.grad.clone() for k, p in model.named_parameters()}, {k: p.detach().clone()
                                                                            for k, p in model.named_parameters()}


def adam_update(grads: dict[str, torch.Tensor], eps: float) -> dict[str, torch.Tensor]:
    """One Adam step (bias-corrected, betas 0.9/0.999) on gradients clipped to a global norm of CLIP."""
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values()))
    scale = min(1.0, CLIP / (float(norm) + 1e-6))
    out = {}
    for k, g in grads.items():
        g = g * scale
        m, v = 0.1 * g / (1 - 0.9), 0.001 * g * g / (1 - 0.999)
        out[k] = -LR * m / (v.sqrt() + eps)
    return out


def rlx_step(model_dir: str, groups, eps: float):
    """rlx's trainer on the batch: loss, the gradient it steps with (HF names), and the update it applies."""
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.trainer import Trainer
    from rlx.types import RolloutBatch

    cfg = parse_config(json.dumps({
        "model": {"path": model_dir},
        "train": {"num_steps": 1, "max_tokens_per_micro_batch": MICRO_BATCH,
                  "optim": {"lr": LR, "clip_grad": CLIP, "adam_eps": eps, "weight_decay": 0.0},
                  "objective": {"advantage": "grpo", "loss": "ppo_clip", "loss_norm": "token"}},
    }))
    trainer = Trainer(cfg, build_plugins())
    before = dict(trainer.hf_tensors())
    before = {k: v.clone() for k, v in before.items()}
    grads: dict[str, torch.Tensor] = {}
    optimizer = trainer.actor.optimizer
    step = optimizer.step

    def capture():
        main = {n: p.main_grad.detach().clone() for n, p in trainer.actor.model.named_parameters()}
        grads.update(trainer.spec.to_hf(trainer.actor.stage, lambda name: [main[name]]))
        return step()

    optimizer.step = capture
    packed = trainer.step_fn.packed([s for g in groups for s in g.trainable])
    metrics = trainer.train_step(RolloutBatch(0, groups))
    after = dict(trainer.hf_tensors())
    return metrics, grads, {k: after[k] - before[k] for k in after}, len(packed)


def trl_loss(model_dir: str, samples, adv):
    """TRL's GRPO loss (``loss_type="dapo"``) on the same samples and advantages: loss and gradient."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.get_input_embeddings().padding_idx = None
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(Path(sys.argv[2]).parent / "trl"), per_device_train_batch_size=len(samples),
                      num_generations=len(samples), loss_type="dapo", beta=0.0, epsilon=0.2, report_to=[],
                      use_cpu=True, bf16=False, save_strategy="no")
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}]), processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets for one accumulation step
    p = max(len(s.prompt_ids) for s in samples)
    c = max(len(s.response_ids) for s in samples)
    pad = 0
    inputs = {
        "prompt_ids": torch.tensor([[pad] * (p - len(s.prompt_ids)) + s.prompt_ids for s in samples]),
        "prompt_mask": torch.tensor([[0] * (p - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in samples]),
        "completion_ids": torch.tensor([s.response_ids + [pad] * (c - len(s.response_ids)) for s in samples]),
        "completion_mask": torch.tensor([[1] * len(s.response_ids) + [0] * (c - len(s.response_ids))
                                         for s in samples]),
        "tool_mask": torch.tensor([s.loss_mask + [0] * (c - len(s.response_ids)) for s in samples]),
        "num_items_in_batch": torch.tensor(float(sum(sum(s.loss_mask) for s in samples))),
        "advantages": torch.tensor([adv[s.sample_id] for s in samples], dtype=torch.float32),
    }
    model.train()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return float(loss.detach()), {k: q.grad.detach().clone() for k, q in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    from transformers import AutoConfig

    groups = batch(AutoConfig.from_pretrained(model_dir).vocab_size)
    samples = [s for g in groups for s in g.samples]
    adv = reference_advantages(groups)
    loss64, g64, _ = reference(model_dir, samples, adv)
    norm64 = float(torch.sqrt(sum((g ** 2).sum() for g in g64.values())))
    clipped = [float(g.abs().median()) * min(1.0, CLIP / norm64) for g in g64.values() if g.abs().max() > 0]
    eps = sorted(clipped)[len(clipped) // 2]  # an epsilon the size of a typical clipped gradient entry:
    #                                          where it is added and what it is added to changes the update
    metrics, grads, update, micro_batches = rlx_step(model_dir, groups, eps)
    ref_update = adam_update(g64, eps)
    trl, g_trl = trl_loss(model_dir, samples, adv)

    from rlx.plugins import build_plugins

    rlx_adv = build_plugins().build("advantages", "grpo").advantages(groups)
    names = [k for k in g64 if k in grads]
    out.write_text(json.dumps({
        "micro_batches": micro_batches,
        "advantages": {"rlx": {str(k): v for k, v in rlx_adv.items()}, "reference": {str(k): v for k, v in adv.items()}},
        "loss": {"rlx": metrics["loss"], "reference": loss64, "trl": trl},
        "grad_norm": {"rlx": metrics["grad_norm"], "reference": norm64, "clip": CLIP},
        "grads": {k: [rel(grads[k], g64[k]), rel(g_trl[k], g64[k])] for k in names},
        "missing": sorted(set(g64) - set(grads)),
        "update": {k: rel(update[k], ref_update[k]) for k in names},
    }))


if __name__ == "__main__":
    main()
