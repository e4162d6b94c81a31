"""`builtin://tiny-qwen3-arith`, the quickstart's model: the random tiny-qwen3 after a few seconds of supervised
training on the answers to the training prompts. It must answer some prompts right (so that RL has a success rate
to raise) and not all (so that there is something to raise), and it must never have seen a held-out prompt."""

import json
from pathlib import Path

import pytest
import torch

from rlx.tasks import arithmetic

ROOT = Path(__file__).parents[2]
HELDOUT = [json.loads(line) for line in (ROOT / "examples" / "data" / "arithmetic_eval.jsonl").open()]


def greedy_right(path: str, rows: list[dict]) -> float:
    """The fraction of `rows` the model at `path` answers exactly, decoding greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    right = 0
    for r in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=end, pad_token_id=end)
        right += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == r["label"]
    return right / len(rows)


@pytest.fixture(scope="module")
def warm(tiny_model_path):  # tiny_model_path: the session's private model cache
    from rlx.models.tiny import resolve_model_path

    return resolve_model_path("builtin://tiny-qwen3-arith")


def test_the_warm_model_answers_some_prompts_right_and_the_random_one_none(warm, tiny_model_path):
    train = list({r["prompt"]: r for r in arithmetic(512, seed=0)}.values())
    assert 0.2 <= greedy_right(warm, train[:100]) <= 0.7
    assert 0.0 < greedy_right(warm, HELDOUT) <= 0.4  # it generalises a little: RL takes it further
    assert greedy_right(tiny_model_path, HELDOUT) == 0.0


def test_no_held_out_prompt_is_among_those_it_was_trained_on():
    trained = {r["prompt"] for r in arithmetic(512, seed=0)}
    assert {r["prompt"] for r in HELDOUT}.isdisjoint(trained)
    assert trained == {json.loads(line)["prompt"] for line in (ROOT / "examples" / "data" / "arithmetic.jsonl").open()}
