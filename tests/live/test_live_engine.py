"""rlx's engine client against a live SGLang 0.5.23 server on the CPU: generation and its log-probs (against
the trainer's forward), the control routes rlx calls, weight updates from disk checked by SGLang's own
checksum, and an id outside the vocabulary, which would kill the server, never reaching it."""

import asyncio

import pytest
import torch

from rlx.config import SamplingConfig
from rlx.rollout.context import GenerateContext
from rlx.rollout.engines.client import EngineClient, GenerateRequest
from rlx.rollout.session import vocab_size

pytestmark = [pytest.mark.integration, pytest.mark.live]


def call(url, fn):
    async def run():
        async with EngineClient(url, timeout_s=120) as c:
            return await fn(c)

    return asyncio.run(run())


def hf_logprobs(model_path: str, prompt: list[int], out: list[int]) -> list[float]:
    """The trainer's view: an fp32 forward of transformers on prompt + output, log-probs of the output ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0].tolist()


def test_generation_and_its_log_probs_match_the_trainers_forward(sglang_server, tiny_model_path):
    prompt = [5, 17, 42, 9, 33, 12]
    req = GenerateRequest(prompt, {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True})
    (res,) = call(sglang_server, lambda c: c.generate(req))
    assert len(res.output_ids) == 24 == len(res.output_logprobs) and res.finish_reason == "length"
    assert res.prompt_tokens == len(prompt) and res.weight_version
    ref = hf_logprobs(tiny_model_path, prompt, res.output_ids)
    diff = max(abs(a - b) for a, b in zip(res.output_logprobs, ref, strict=True))
    print(f"live SGLang (fp32, CPU) against the trainer's fp32 forward: max |log-prob diff| {diff:.2e}")
    assert diff < 1e-3
    # n samples of one prompt in one request, as rlx joins a group
    many = call(sglang_server, lambda c: c.generate(GenerateRequest(prompt, {"max_new_tokens": 4, "n": 3})))
    assert len(many) == 3 and all(len(r.output_ids) == len(r.output_logprobs) > 0 for r in many)


def test_an_id_outside_the_vocabulary_never_reaches_the_server(sglang_server, tiny_model_path):
    vocab = vocab_size(tiny_model_path)

    async def run():
        async with EngineClient(sglang_server, timeout_s=120) as c:
            ctx = GenerateContext(c, None, SamplingConfig(max_new_tokens=2), vocab_size=vocab)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="outside the model's vocabulary"):
                await ctx.generate([1, vocab, 2], ctx.sampling_params())
            return await ctx.generate([1, vocab - 1, 2], ctx.sampling_params())

    assert len(asyncio.run(run()).output_ids) > 0
    assert call(sglang_server, lambda c: c.health())  # still serving


def test_control_routes_rlx_calls(sglang_server):
    info = call(sglang_server, lambda c: c.server_info())
    assert info["version"] == "0.5.23" and info["device"] == "cpu"
    assert call(sglang_server, lambda c: c.context_length()) > 0
    assert call(sglang_server, lambda c: c.tp_size()) == 1

    async def pause_abort_resume(c):
        await c.pause("abort")
        await c.resume()
        await c.abort()
        await c.flush_cache()
        return await c.generate(GenerateRequest([3, 4, 5], {"max_new_tokens": 2}))

    assert len(call(sglang_server, pause_abort_resume)[0].output_ids) == 2


def test_weights_from_disk_change_what_sglang_serves_and_its_checksum(sglang_server, tiny_model_path, tmp_path):
    """A changed checkpoint loaded with /update_weights_from_disk: the version moves, SGLang's own checksum
    (/weights_checker) changes, and loading the original back restores it bit for bit."""
    import shutil

    from safetensors.torch import load_file, save_file

    before = call(sglang_server, lambda c: c.weights_checker())
    changed = tmp_path / "changed"
    shutil.copytree(tiny_model_path, changed)
    for f in changed.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v * 1.5 if v.dim() == 2 else v for k, v in tensors.items()}, f, metadata={"format": "pt"})

    async def load(c, path, version):
        await c.update_weights_from_disk(str(path), weight_version=version)
        return await c.weight_version(), await c.weights_checker()

    version, after = call(sglang_server, lambda c: load(c, changed, "7"))
    assert version == "7" and after["per_engine_checksum"] != before["per_engine_checksum"]
    version, back = call(sglang_server, lambda c: load(c, tiny_model_path, "8"))
    assert version == "8" and back["per_engine_checksum"] == before["per_engine_checksum"]


def test_a_mixture_of_experts_model_serves_and_its_log_probs_match(sglang_py, sglang_launcher, tmp_path):
    """The tiny Qwen3-MoE (rlx-model-qwen) on SGLang's CPU kernels; routing replay cannot run there (rlx refuses it
    at launch: tests/unit/test_launch.py)."""
    from rlx.models.tiny import resolve_model_path

    path = resolve_model_path("builtin://tiny-qwen3-moe")
    proc, url = sglang_launcher(sglang_py, path, tmp_path / "moe.log")
    try:
        prompt = [5, 17, 42, 9]
        (res,) = call(url, lambda c: c.generate(GenerateRequest(prompt, {"max_new_tokens": 16, "ignore_eos": True})))
    finally:
        proc.stop()
    ref = hf_logprobs(path, prompt, res.output_ids)
    diff = max(abs(a - b) for a, b in zip(res.output_logprobs, ref, strict=True))
    print(f"live SGLang, tiny Qwen3-MoE (fp32, CPU) against transformers' fp32 forward: max |log-prob diff| {diff:.2e}")
    assert len(res.output_ids) == 16 and diff < 1e-3
