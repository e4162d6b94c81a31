"""The embedded engine serves LoRA adapters as SGLang does with ``--enable-lora``: loaded at run time from a peft
folder or from tensors (checked against the sender's checksums), named per request, several in one batch beside the
base model (or all of one adapter, or none), each request's log-probs those of peft's model with its adapter;
unloaded once the requests using it end.
(SGLang's request and answer types check these exchanges: tests/integration/test_sglang_code.py.)"""

import asyncio
import json

import pytest
import torch

from rlx.rollout.engines.client import EngineClient, EngineError, GenerateRequest
from rlx.rollout.engines.launch import HOST, ManagedProcess, embedded_command, free_port, wait_healthy
from rlx.transport.payloads import serialize_tensor_dict, sha256

pytestmark = pytest.mark.integration

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter(path, seed: int, rank: int = 4, targets=TARGETS):
    """A peft adapter with random A and B (B is zero at peft's init: the model would not change)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module")
def lora_engine(tiny_model_path, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("lora-engine") / "engine.log"
    args = {"num_threads": 1, "enable_lora": True, "max_lora_rank": 8, "lora_target_modules": TARGETS}
    proc = ManagedProcess(embedded_command(tiny_model_path, port, server_args=args), log)
    proc.start()
    url = f"http://{HOST}:{port}"
    try:
        asyncio.run(wait_healthy(url, proc, 120))
        yield url
    finally:
        proc.stop()


def logprobs_of(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def test_adapters_from_disk_and_tensors_serve_mixed_batches_as_peft(lora_engine, tiny_model_path, tmp_path):
    from peft.utils import get_peft_model_state_dict

    a, b = random_adapter(tiny_model_path, 1), random_adapter(tiny_model_path, 2, targets=["q_proj", "v_proj"])
    a.save_pretrained(tmp_path / "a")
    tensors = {k: v.contiguous() for k, v in get_peft_model_state_dict(b).items()}  # (base_model.model.<module>...)
    config = b.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    prompt = [5, 17, 42, 9, 33]

    async def calls():
        async with EngineClient(lora_engine) as c:
            assert (await c.load_lora_adapter("a", str(tmp_path / "a")))["loaded_adapters"] == {"a": str(tmp_path / "a")}
            bad = dict.fromkeys(tensors, "0" * 64)
            with pytest.raises(EngineError, match="adapter sync MISMATCH"):  # arrived otherwise than sent: refused
                await c.load_lora_adapter_from_tensors("b", json.loads(json.dumps(config, default=str)),
                                                       [serialize_tensor_dict(tensors)], bad)
            await c.load_lora_adapter_from_tensors("b", json.loads(json.dumps(config, default=str)),
                                                   [serialize_tensor_dict(tensors)],
                                                   {n: sha256(t) for n, t in tensors.items()})
            with pytest.raises(EngineError, match="already loaded"):
                await c.load_lora_adapter("a", str(tmp_path / "a"))
            models = await c.request("GET", "/v1/models")
            assert {m["id"]: m.get("parent") for m in models["data"][1:]} == {"a": models["data"][0]["id"],
                                                                              "b": models["data"][0]["id"]}
            # one request, three prompts: the base model, a and b in one batch
            body = {"input_ids": [prompt] * 3, "lora_path": [None, "a", "b"], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
            out = await c.request("POST", "/generate", body)
            # batches of one adapter, of the base model alone, mixed again
            for lora_path in ("b", None, "a", [None, "a", "b"]):
                out += await c.request("POST", "/generate", {**body, "lora_path": lora_path})
            with pytest.raises(EngineError, match="requested LoRA adapters are not loaded: c"):
                await c.generate(GenerateRequest(prompt, {"max_new_tokens": 2}, lora_path="c"))
            return out

    out = asyncio.run(calls())
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    a, b = a.eval(), b.eval()
    for res, model in zip(out, [base, a, b] + [b] * 3 + [base] * 3 + [a] * 3 + [base, a, b], strict=True):
        got = torch.tensor([t[0] for t in res["meta_info"]["output_token_logprobs"]])
        assert (got - logprobs_of(model, prompt, res["output_ids"])).abs().max() < 1e-4
    assert len({tuple(r["output_ids"]) for r in out}) > 1  # the adapters change what is generated


def test_an_unload_waits_for_the_requests_using_the_adapter(lora_engine, tiny_model_path, tmp_path):
    import aiohttp

    random_adapter(tiny_model_path, 3).save_pretrained(tmp_path / "c")

    async def calls():
        async with EngineClient(lora_engine) as c:
            await c.load_lora_adapter("c", str(tmp_path / "c"))
            body = {"input_ids": [5, 6, 7], "lora_path": "c", "stream": True,
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
            async with aiohttp.ClientSession() as s, s.post(f"{lora_engine}/generate", json=body) as resp:
                first = await resp.content.readline()  # the request runs
                assert first.startswith(b"data:")
                unload = asyncio.ensure_future(c.unload_lora_adapter("c"))
                while any(m["id"] == "c" for m in (await c.request("GET", "/v1/models"))["data"]):
                    await asyncio.sleep(0.01)  # (the unload reaches the engine)
                with pytest.raises(EngineError, match="not loaded: c"):  # no new request may name it
                    await c.generate(GenerateRequest([5], {"max_new_tokens": 2}, lora_path="c"))
                assert not unload.done()  # the running request still has it
                last = None
                async for line in resp.content:
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        last = json.loads(line[5:])
            assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 200
            assert "c" not in (await unload)["loaded_adapters"]
            await c.load_lora_adapter("c", str(tmp_path / "c"))  # the name is free again

    asyncio.run(calls())
