"""The embedded engine generates with Qwen3-Next: its linear-attention layers keep a convolution window and a
recurrent state per row, which continuous batching selects, forks and joins like the attention layers' keys and
values (without padding them). Every log-prob equals a plain forward pass of the whole sequence."""

import threading
import time

import pytest
import torch


@pytest.fixture(scope="module")
def engine_parts():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.models.tiny import resolve_model_path

    path = resolve_model_path("builtin://tiny-qwen3-next")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def forward_logprobs(model, prompt, output):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0]
    logp = torch.log_softmax(logits, -1)
    return logp[torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1), torch.tensor(output)].tolist()


def test_padded_forked_and_joining_rows_generate_what_a_plain_forward_gives(engine_parts):
    from rlx.rollout.engines.embedded.scheduler import Request, SamplingParams, Scheduler

    model, tok = engine_parts
    s = Scheduler(model, tok, prefix_cache_tokens=4096, seed=1)
    assert s.prefix is None  # a prefix's state is not per token: no prefix cache for these layers
    s.start()
    try:
        params = dict(temperature=1.0, ignore_eos=True)
        first = ([Request([1, 264, 263, 201, 284, 324, 7, 8], SamplingParams(max_new_tokens=16, **params))
                  for _ in range(3)]  # one prompt's samples: a forked prefill
                 + [Request([1, 5, 9], SamplingParams(max_new_tokens=4, **params))])  # shorter: left padding
        later = [Request(list(range(3, 20)), SamplingParams(max_new_tokens=8, **params)),
                 Request([7, 7, 7, 7, 7], SamplingParams(max_new_tokens=8, **params))]
        left, done = [len(first) + len(later)], threading.Event()

        def finished(_r):  # in the scheduler's thread
            left[0] -= 1
            if not left[0]:
                done.set()

        for r in first + later:
            r.on_done = finished
        for r in first:
            s.submit(r)
        deadline = time.monotonic() + 60
        while len(first[0].output_ids) < 3:  # the first rows are decoding when the later ones join
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for r in later:
            s.submit(r)
        assert done.wait(120)
        assert s.prefill_batches == 2 and first[0].finish_reason["type"] == "length"
        for r in first + later:
            assert len(r.output_ids) == r.params.max_new_tokens
            assert r.logprobs == pytest.approx(forward_logprobs(model, r.input_ids, r.output_ids), abs=1e-4)
    finally:
        s.shutdown()


def test_prefill_runs_the_kernel_model_kernels_chooses(engine_parts, capsys):
    """``--kernels '{"gdn": "torch"}'`` (rlx passes model.kernels): transformers' chunked gated delta rule is replaced
    by the kernels hook's, and the model's logits are unchanged (the torch kernel is transformers' math)."""
    import importlib

    from rlx.rollout.engines.embedded.gdn_kernel import use_gdn_kernel

    model, _ = engine_parts
    ids = torch.randint(3, 200, (2, 70), generator=torch.Generator().manual_seed(0))  # more than one chunk
    with torch.no_grad():
        before = model(input_ids=ids).logits
    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    original = module.torch_chunk_gated_delta_rule
    restore = use_gdn_kernel(model, "torch")
    try:
        assert module.torch_chunk_gated_delta_rule is not original
        with torch.no_grad():
            after = model(input_ids=ids).logits
    finally:
        restore()
    assert module.torch_chunk_gated_delta_rule is original
    assert (after - before).abs().max().item() < 1e-4
    restore = use_gdn_kernel(model, "flashqla")  # a GPU trainer's choice on a CPU engine: auto, with a warning
    restore()
    assert capsys.readouterr().err.count("model.kernels.gdn: 'flashqla' cannot run here") == 1
