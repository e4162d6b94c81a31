"""Speculative decoding in the embedded engine: acceptance rate, tokens per verify step and tokens/s with n-gram
drafts beside plain decoding, on the same model, requests and threads, one after the other.

Two workloads:

* agent: a context that holds text the model is writing again, as when a coding agent's tool output shows it the
  file it edits and it rewrites it. The "file" is the model's own greedy continuation of a prompt (a random model
  has nothing else it would write); the request is that file, a separator and the file's first 16 tokens, and the
  model goes on for `--tokens`, greedy and at temperature 0.6.
* arithmetic: the quickstart's task and model (``builtin://tiny-qwen3-arith``, its prompts, temperature 1, up to 16
  new tokens, stopping at EOS), its first 256 prompts: short answers with little to look up.

Each point runs every request once through the engine's scheduler (its core, without HTTP), a batch of 16 at once,
and is the median of 5 timed runs after a warm-up, plain and drafted alternating.

    python benchmarks/speculative.py [--model builtin://small-qwen3] [--draft-tokens 4] [--tokens 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

REPEATS = 5


def run(model, tok, prompts: list[list[int]], params, speculative: int, seed: int = 0) -> dict[str, float]:
    from rlx.testing.runs import decode

    reqs, s, seconds = decode(model, tok, prompts, params, speculative=speculative, seed=seed, max_running=16)
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"tokens/s": tokens / seconds, "forwards": s.steps + s.prefill_batches,
            "accept": s.spec_correct / s.spec_proposed if s.spec_proposed else 0.0,
            # tokens per verify step of a request, as SGLang's spec_accept_length (the prefill's token included)
            "per_step": tokens / s.spec_verify_ct if s.spec_verify_ct else 0.0,
            "verify": s.spec_verify_ct, "tokens": tokens}


def point(model, tok, prompts, params, k: int) -> tuple[dict[str, float], dict[str, float]]:
    run(model, tok, prompts[:2], params, k)  # warm-up
    plain, spec = [], []
    for i in range(REPEATS):  # alternating, so that drift in the machine's speed hits both
        plain.append(run(model, tok, prompts, params, 0, seed=i))
        spec.append(run(model, tok, prompts, params, k, seed=i))

    def median(rows):
        return {key: statistics.median(r[key] for r in rows) for key in rows[0]}

    return median(plain), median(spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin://small-qwen3", help="the agent workload's model")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from transformers import AutoTokenizer

    from rlx.models.load import load_lm
    from rlx.models.tiny import resolve_model_path
    from rlx.rollout.engines.embedded.sampling import SamplingParams

    print(f"embedded engine, {args.threads} threads, n-gram drafts of {args.draft_tokens}, batches of 16, "
          f"median of {REPEATS}")
    print(f"{'workload':<34} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'accepted':>8} "
          f"{'tok/verify':>10} {'forwards':>15}")

    def show(name, plain, spec):
        print(f"{name:<34} {plain['tokens/s']:>11.0f} {spec['tokens/s']:>10.0f} "
              f"{spec['tokens/s'] / plain['tokens/s']:>6.2f}x {spec['accept']:>8.2f} {spec['per_step']:>10.2f} "
              f"{int(plain['forwards']):>6} -> {int(spec['forwards']):<6}")

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = load_lm(path, torch.float32).eval()
    seeds = [tok.encode(f"def f{i}(x):\n    return x * {i} +", add_special_tokens=False) for i in range(16)]
    from rlx.testing.runs import decode

    done, _, _ = decode(model, tok, seeds, SamplingParams(temperature=0, max_new_tokens=128, ignore_eos=True),
                        max_running=16)
    files = [r.input_ids + r.output_ids for r in done]
    sep = tok.encode("\n---\n", add_special_tokens=False)
    agent = [f + sep + f[:16] for f in files]
    for temperature in (0.0, 0.6):
        params = SamplingParams(temperature=temperature, max_new_tokens=args.tokens, ignore_eos=True)
        show(f"agent ({args.model.split('/')[-1]}, t={temperature})", *point(model, tok, agent, params,
                                                                               args.draft_tokens))

    path = resolve_model_path("builtin://tiny-qwen3-arith")
    tok = AutoTokenizer.from_pretrained(path)
    model = load_lm(path, torch.float32).eval()
    rows = [json.loads(line) for line in open("examples/data/arithmetic.jsonl")][:256]
    prompts = []
    for r in rows:
        out = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                      tokenize=True)
        prompts.append(list(out["input_ids"] if hasattr(out, "keys") else out))
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    show("arithmetic (quickstart, t=1)", *point(model, tok, prompts, params, args.draft_tokens))


if __name__ == "__main__":
    main()
