"""The embedded engine behind the real sglang-router, driven over HTTP; every id and logprob the engine
returns is checked against a forward pass of the same model."""

import asyncio
import os
import signal
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.config import parse_config
from rlx.rollout.engines.client import EngineClient, EngineError, GenerateRequest
from rlx.rollout.engines.fleet import EngineFleet
from rlx.transport.payloads import serialize_named_tensors, tensor_hash

pytestmark = pytest.mark.integration

PROMPTS = [[1, 264, 263, 201, 284, 324], [1, 67, 85], [300, 301, 302, 303, 304, 305, 306, 307], [5]]


def run(coro):
    return asyncio.run(coro)


def call(url, fn):
    async def go():
        async with EngineClient(url) as c:
            return await fn(c)

    return run(go())


@pytest.fixture(scope="module")
def fleet(tiny_model_path, tmp_path_factory):
    cfg = parse_config("""
model: {path: builtin://tiny-qwen3}
rollout:
  engines: [{num_engines: 2, server_args: {num_threads: 1}}]
  router: {policy: round_robin}
""")
    f = EngineFleet(cfg, tmp_path_factory.mktemp("logs"))
    run(f.start())
    yield f
    run(f.stop())
    assert all(e.process is None or not e.process.alive() for e in f.engines)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def forward_logprobs(model, prompt, output, temperature=1.0):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[pos, torch.tensor(output)].tolist(), logits[pos].argmax(-1).tolist()


async def generate_many(url, reqs):
    async with EngineClient(url) as c:
        return await asyncio.gather(*(c.generate(r) for r in reqs))


def test_concurrent_sampled_ids_and_logprobs_match_a_forward_pass(fleet, model):
    reqs = [GenerateRequest(PROMPTS[i % 4], {"max_new_tokens": 6 + i, "temperature": 1.0, "ignore_eos": True}) for i in range(12)]
    results = run(generate_many(fleet.url, reqs))
    for req, (res,) in zip(reqs, results):
        assert len(res.output_ids) == req.sampling_params["max_new_tokens"] and res.finish_reason == "length"
        want, _ = forward_logprobs(model, req.input_ids, res.output_ids)
        assert res.output_logprobs == pytest.approx(want, abs=2e-4)
    served = run(fleet.for_each(lambda c: c.server_info()))
    assert all(s["internal_states"][0]["generated_tokens"] > 0 for s in served), "round robin used both"


def test_greedy_is_the_argmax_and_n_gives_n_samples(fleet, model):
    (a, b, c), = run(generate_many(fleet.url, [GenerateRequest(PROMPTS[2], {"max_new_tokens": 5, "temperature": 0, "n": 3})]))
    assert a.output_ids == b.output_ids == c.output_ids
    _, argmax = forward_logprobs(model, PROMPTS[2], a.output_ids)
    assert a.output_ids == argmax


def test_prompt_log_probs_top_log_probs_and_asked_ids_are_a_forward_pass(fleet, model):
    """SGLang's return_logprob extras (a teacher's scoring API): ``logprob_start_len`` gives the prompt's tokens from
    that index with the log-prob their position before gives them (none for the first, as SGLang), ``top_logprobs_num``
    the top log-probs at each prompt position and at each sampled token (at the sampling temperature, as its log-prob),
    ``token_ids_logprob`` those ids' log-probs; ``max_new_tokens: 0`` scores a prompt without generating, with SGLang's
    one entry of output top log-probs (plain, from the last position); a prompt already in the prefix cache is scored
    whole; per-prompt values in a batch; a start past the prompt is SGLang's 400."""
    prompt = PROMPTS[2]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)

    def post(body):
        return call(fleet.engines[0].url, lambda c: c.request("POST", "/generate", body))

    post({"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})  # the prompt in this engine's prefix cache
    for _ in range(2):
        out = post({"input_ids": prompt, "sampling_params": {"max_new_tokens": 0, "temperature": 0.5},
                    "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3,
                    "token_ids_logprob": [7, 300]})["meta_info"]
        assert out["input_token_logprobs"][0] == [None, prompt[2], None] and out["completion_tokens"] == 0
        assert out["cached_tokens"] == 0  # scored whole, not from the cache
        # plain log-softmax whatever the temperature, as SGLang's prompt log-probs
        got = [lp for lp, _, _ in out["input_token_logprobs"][1:]]
        assert got == pytest.approx([logp[i - 1, prompt[i]].item() for i in range(3, len(prompt))], abs=1e-5)
        assert out["input_top_logprobs"][0] is None and len(out["input_top_logprobs"]) == len(prompt) - 2
        for i, top in enumerate(out["input_top_logprobs"][1:], start=2):
            values, best = logp[i].topk(3)
            assert [t for _, t, _ in top] == best.tolist() and [v for v, _, _ in top] == pytest.approx(values.tolist())
        assert [v for x in out["input_token_ids_logprobs"][1:] for v, _, _ in x] == pytest.approx(
            logp[2:-1][:, [7, 300]].flatten().tolist(), abs=1e-5)
        [last] = out["output_top_logprobs"]  # SGLang's one entry, plain, from the last position
        assert [t for _, t, _ in last] == logp[-1].topk(3).indices.tolist()
        assert [v for v, _, _ in last] == pytest.approx(logp[-1].topk(3).values.tolist(), abs=1e-5)
    out = post({"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0.5, "ignore_eos": True},
                "return_logprob": True, "top_logprobs_num": 2})["meta_info"]
    assert out["input_token_logprobs"] == [] and out["input_top_logprobs"] == []
    sampled = [t for _, t, _ in out["output_token_logprobs"]]
    with torch.no_grad():
        scaled = torch.log_softmax(model(input_ids=torch.tensor([prompt + sampled])).logits[0].float() / 0.5, -1)
    assert len(out["output_top_logprobs"]) == len(sampled) == 3
    for j, top in enumerate(out["output_top_logprobs"]):
        values, best = scaled[len(prompt) - 1 + j].topk(2)
        assert [t for _, t, _ in top] == best.tolist() and [v for v, _, _ in top] == pytest.approx(values.tolist(),
                                                                                                   abs=1e-4)
    both = post({"input_ids": [prompt, PROMPTS[0]], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
                 "logprob_start_len": [5, 0]})
    assert [len(b["meta_info"]["input_token_logprobs"]) for b in both] == [len(prompt) - 5, len(PROMPTS[0])]
    with pytest.raises(EngineError, match="logprob_start_len=9 is higher than the number of input tokens"):
        post({"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
              "logprob_start_len": 9})
    huge = post({"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
                 "top_logprobs_num": 10**6, "token_ids_logprob": []})["meta_info"]  # the whole vocabulary; [] is none
    assert len(huge["output_top_logprobs"][0]) == model.config.vocab_size and "output_token_ids_logprobs" not in huge
    with pytest.raises(EngineError, match="Cannot use list logprob_start_len with parallel_sample_num > 1"):
        post({"input_ids": [prompt, prompt], "sampling_params": {"max_new_tokens": 1, "n": 2}, "return_logprob": True,
              "logprob_start_len": [0, 1]})


def test_stop_token_ids_and_stop_strings(fleet, model):
    (base,), = run(generate_many(fleet.url, [GenerateRequest(PROMPTS[0], {"max_new_tokens": 12, "temperature": 0})]))
    stop_id = base.output_ids[3]
    first = base.output_ids.index(stop_id)
    (res,), = run(generate_many(fleet.url, [GenerateRequest(PROMPTS[0], {"max_new_tokens": 12, "temperature": 0,
                                                                        "stop_token_ids": [stop_id]})]))
    assert res.finish_reason == "stop" and res.matched_stop == stop_id
    assert res.output_ids == base.output_ids[: first + 1]  # the stop token is kept in the ids
    stop_text = base.text[len(base.text) // 2:][:2]
    (res,), = run(generate_many(fleet.url, [GenerateRequest(PROMPTS[0], {"max_new_tokens": 12, "temperature": 0,
                                                                        "stop": [stop_text]})]))
    assert res.finish_reason == "stop" and res.matched_stop == stop_text
    assert stop_text not in res.text and base.text.startswith(res.text)


async def generated_tokens(client) -> float:
    """The engine's ``sglang:generation_tokens_total`` (its Prometheus metrics)."""
    text = await client.request("GET", "/metrics")
    name = "sglang:generation_tokens_total"
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name)))


def test_abort_returns_the_partial_output(fleet):
    engine = fleet.engines[0]

    async def go():
        async with EngineClient(engine.url) as c:
            before = await generated_tokens(c)
            task = asyncio.create_task(c.generate(GenerateRequest(
                PROMPTS[1], {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0}, rid="long-one")))

            async def decoding():
                while await generated_tokens(c) == before:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(decoding(), 30)  # abort once it decodes
            await c.abort("long-one")
            return await asyncio.wait_for(task, 30)

    (res,) = run(go())
    assert res.finish_reason == "abort"
    assert 0 < len(res.output_ids) < 1500 and len(res.output_logprobs) == len(res.output_ids)


def test_pause_in_place_then_continue(fleet):
    engine = fleet.engines[1]

    async def go():
        async with EngineClient(engine.url) as c:
            await c.pause("in_place")
            task = asyncio.create_task(c.generate(GenerateRequest(PROMPTS[0], {"max_new_tokens": 4, "ignore_eos": True})))
            await asyncio.sleep(0.5)
            assert not task.done()
            await c.resume()
            return await asyncio.wait_for(task, 30)

    (res,) = run(go())
    assert len(res.output_ids) == 4


def perturbed(model, scale):
    return {n: p.detach().clone() * scale for n, p in model.named_parameters()}


def test_weight_updates_from_disk_tensor_and_broadcast(fleet, model, tmp_path):
    engine = fleet.engines[0]
    ckpt = tmp_path / "ckpt"

    def check(version, ref_model):
        async def go():
            async with EngineClient(engine.url) as c:
                (res,) = await c.generate(GenerateRequest(PROMPTS[0], {"max_new_tokens": 5, "ignore_eos": True}))
                return res, await c.weight_version()

        res, v = run(go())
        assert res.weight_version == version == v and res.token_weight_versions == [version] * 5
        want, _ = forward_logprobs(ref_model, PROMPTS[0], res.output_ids)
        assert res.output_logprobs == pytest.approx(want, abs=2e-4)

    new = AutoModelForCausalLM.from_pretrained(fleet_model_path(model), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.5)
    new.save_pretrained(ckpt)
    call(engine.url, lambda c: c.update_weights_from_disk(str(ckpt), weight_version="1"))
    check("1", new)

    with torch.no_grad():
        for p in new.parameters():
            p.mul_(0.5)
    payload = serialize_named_tensors(list(new.state_dict().items()))
    # As SGLang 0.5.23: tensor and distributed updates only inside a weight-update session.
    with pytest.raises(EngineError, match="between begin_weight_update"):
        call(engine.url, lambda c: c.update_weights_from_tensor([payload], weight_version="2"))
    assert call(engine.url, lambda c: c.begin_weight_update()) is True
    call(engine.url, lambda c: c.update_weights_from_tensor([payload], weight_version="2"))
    check("2", new)

    # Broadcast: this process is rank 0 of a two-rank gloo group, the engine rank 1 (SGLang's layout).
    from rlx.rollout.engines.launch import free_port
    from rlx.transport.group import open_group

    port = free_port()
    holder = {}
    t = threading.Thread(target=lambda: holder.setdefault("pg", open_group("127.0.0.1", port, 0, 2, "g", "gloo", 60)))
    t.start()
    call(engine.url, lambda c: c.init_weights_update_group("127.0.0.1", port, 1, 2, "g", "gloo"))
    t.join(60)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(3.0)
    named = list(new.state_dict().items())

    async def push():
        async with EngineClient(engine.url) as c:
            task = asyncio.create_task(c.update_weights_from_distributed(
                [n for n, _ in named], [str(x.dtype).removeprefix("torch.") for _, x in named],
                [list(x.shape) for _, x in named], "g", weight_version="3"))
            await asyncio.sleep(0)
            for _, x in named:
                await asyncio.to_thread(lambda x=x: holder["pg"].broadcast(x.contiguous(), 0).wait())
            await task

    run(push())
    call(engine.url, lambda c: c.end_weight_update())
    check("3", new)
    # SGLang serves weights by name for Llama-family models only; the tiny Qwen3 gets its 400.
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(EngineError, match="Get parameter by name failed") as e:
        call(engine.url, lambda c: c.get_weights_by_name(name, 5))
    assert e.value.status == 400
    sums = call(engine.url, lambda c: c.request("POST", "/weights_checksum", {"names": [name], "head": 5}))
    assert sums["checksums"][name] == tensor_hash(new.state_dict()[name].flatten()[:5])


def fleet_model_path(model):
    return model.name_or_path


def test_bad_requests_get_400_in_sglang_error_shape(fleet):
    async def go(body):
        async with EngineClient(fleet.engines[0].url) as c:
            return await c.request("POST", "/generate", body)

    for body, text in [({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
                       ({"input_ids": [], "sampling_params": {}}, "input_ids cannot be empty."),
                       ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0."),
                       ({"input_ids": [1, 2], "sampling_params": {"temperatur": 1}}, "temperatur"),
                       ({"input_ids": [10**9]}, "input_ids")]:
        with pytest.raises(EngineError) as e:
            run(go(body))
        assert e.value.status == 400 and text in str(e.value)
    with pytest.raises(EngineError, match="unknown weight"):
        call(fleet.engines[0].url, lambda c: c.weights_checksum(["nope"]))


def test_router_removes_and_adds_workers(fleet):
    url = fleet.engines[1].url
    run(fleet.router.remove_worker(url))
    assert url not in [w["url"] for w in run(fleet.router.workers())]
    run(fleet.router.add_worker(url))
    assert url in [w["url"] for w in run(fleet.router.workers())]


def test_a_dead_engine_is_a_clear_error_not_a_hang(tiny_model_path, tmp_path):
    cfg = parse_config("model: {path: builtin://tiny-qwen3}\nrollout: {engines: [{server_args: {num_threads: 1}}]}")
    f = EngineFleet(cfg, tmp_path)
    run(f.start())
    try:
        pid = f.engines[0].process.pid
        os.kill(pid, signal.SIGKILL)
        f.engines[0].process.proc.wait(10)
        with pytest.raises(EngineError, match="unreachable"):
            run(generate_many(f.url, [GenerateRequest(PROMPTS[0], {"max_new_tokens": 4})]))
    finally:
        run(f.stop())

