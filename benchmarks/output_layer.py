"""The output layer at response positions only vs at every packed position, on one training step.

    .venv/bin/python benchmarks/output_layer.py                       # SmolLM2-135M-Instruct, 16 samples
    .venv/bin/python benchmarks/output_layer.py --model builtin://tiny-qwen3 --repeats 5

The trainer (one process, megatron on CPU) trains the same batch (issue 19's workload: 4 prompts x 4 samples,
prompts of ``--prompt`` tokens, ``--response`` new tokens each) with its output layer (LM head, log-softmax)
computed only at the positions that predict response tokens (rlx's default) and, for comparison, at every packed
position (megatron's default: prompts and row padding included). The two alternate; printed: the median seconds of
``trainer.train_step`` over ``--repeats`` steps each after a warm-up, and the positions the output layer computed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin://smollm2-135m-instruct")
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.trainer import Trainer
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    cfg = parse_config(json.dumps({"model": {"path": args.model}, "train": {"optim": {"lr": 1e-6}}}))
    trainer = Trainer(cfg, build_plugins())
    vocab = trainer.spec.vocab_size
    g = torch.Generator().manual_seed(0)
    groups = []
    for p in range(4):
        prompt = torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
        samples = [Sample(prompt, torch.randint(3, vocab, (args.response,), generator=g).tolist(),
                          [1] * args.response, [-6.0] * args.response, reward=float(i % 2),
                          status=SampleStatus.COMPLETED, sample_id=4 * p + i, group_id=p) for i in range(4)]
        groups.append(Group(p, samples))
    positions = {True: 0, False: 0}

    def count(module, inputs, output):
        positions[trainer.actor._selects] += inputs[0].shape[0] * inputs[0].shape[1]

    trainer.actor.model.output_layer.register_forward_hook(count)
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.repeats + 1):
        for selects in (True, False):
            trainer.actor._selects = selects
            t0 = time.perf_counter()
            trainer.train_step(RolloutBatch(step + 1, groups))
            if step:  # the first round warms up
                times[selects].append(time.perf_counter() - t0)
    per_step = {k: v // (args.repeats + 1) for k, v in positions.items()}
    print(f"{args.model}: 16 samples of {args.prompt} + {args.response} tokens, vocabulary {vocab}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'output layer at':<32} {'train step s':>12} {'positions per step':>19}")
    for selects, label in ((True, "response positions (rlx)"), (False, "every packed position")):
        print(f"{label:<32} {statistics.median(times[selects]):>12.2f} {per_step[selects]:>19}")


if __name__ == "__main__":
    main()
