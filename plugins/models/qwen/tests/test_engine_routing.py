"""The embedded engine reports the experts it routed each token to in SGLang's format (request
``return_routed_experts``, ``meta_info.routed_experts`` = base64 int32 [prompt + output - 1, layers, top_k]), for
concurrent, left-padded, KV-cached requests; checked against a plain transformers forward of the same tokens, and
against SGLang's own request type and decoder."""

import asyncio
import base64
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.integration


def routed(res, layers=2, topk=2):
    return np.frombuffer(base64.b64decode(res.routed_experts), dtype=np.int32).reshape(-1, layers, topk)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from rlx.config import parse_config
    from rlx.rollout.engines.fleet import EngineFleet
    from rlx.rollout.engines.client import EngineClient, EngineError, GenerateRequest

    cfg = parse_config("model: {path: builtin://tiny-qwen3-moe}\n"
                       "rollout: {routed_experts: true, engines: [{server_args: {num_threads: 1}}]}")
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46], [9], [100, 101, 102, 103]]

    async def go():
        fleet = EngineFleet(cfg, tmp_path_factory.mktemp("logs"))
        await fleet.start()
        try:
            async with EngineClient(fleet.engines[0].url) as c:
                reqs = [GenerateRequest(p, {"max_new_tokens": 3 + 2 * i, "ignore_eos": True}, True, None, True)
                        for i, p in enumerate(prompts)]
                reqs.append(GenerateRequest(prompts[0], {"max_new_tokens": 2}, True, None, False))  # not asked
                out = [r for (r,) in await asyncio.gather(*(c.generate(q) for q in reqs))]
                raw = await c.request("POST", "/generate", {"input_ids": prompts[1], "return_routed_experts": True,
                                                            "routed_experts_start_len": 3,
                                                            "sampling_params": {"max_new_tokens": 2}})
                try:
                    await c.request("POST", "/generate", {"input_ids": prompts[2], "return_routed_experts": True,
                                                          "routed_experts_start_len": 5})
                    bad = None
                except EngineError as e:
                    bad = e
            return reqs, out, raw, bad
        finally:
            await fleet.stop()

    return asyncio.run(go())


def test_routing_of_every_token_matches_a_plain_forward(results):
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import resolve_model_path

    reqs, out, raw, _ = results
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin://tiny-qwen3-moe"),
                                                 dtype=torch.float32).eval()
    for req, res in zip(reqs[:4], out[:4], strict=True):
        ids = req.input_ids + res.output_ids
        got = routed(res)
        assert got.shape == (len(ids) - 1, 2, 2)  # the last sampled token never went through the model
        with torch.no_grad():
            logits = model(torch.tensor([ids[:-1]]), output_router_logits=True).router_logits
        for layer, lg in enumerate(logits):
            want = torch.topk(torch.softmax(lg.float(), -1), 2, dim=-1).indices.sort(-1).values.numpy()
            assert (np.sort(got[:, layer], -1) == want).all(), f"layer {layer}"
    assert out[4].routed_experts is None  # a request that did not ask gets no field
    full = routed(out[1])
    start = np.frombuffer(base64.b64decode(raw["meta_info"]["routed_experts"]), np.int32).reshape(-1, 2, 2)
    assert start.shape == (len(reqs[1].input_ids) + 2 - 1 - 3, 2, 2)  # from routed_experts_start_len on


def test_a_start_past_the_prompt_is_refused_as_sglang_does(results):
    error = results[3]
    assert error is not None and error.status == 400
    assert "routed_experts_start_len=5 is higher than the number of input tokens" in str(error)


def test_sglangs_own_request_type_and_decoder_agree(results, tmp_path):
    reqs, out, _, _ = results
    (tmp_path / "case.json").write_text(json.dumps({"body": reqs[0].to_json(), "meta": out[0].raw["meta_info"]}))
    script = textwrap.dedent("""
        import json, sys
        from rlx.testing.sglang_code import load
        load()
        import sglang.srt.managers.io_struct as io
        from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info
        case = json.load(open(sys.argv[1]))
        req = io.GenerateReqInput(**case["body"])
        print("RESULT", json.dumps({"asked": req.return_routed_experts,
                                    "ids": extract_routed_experts_from_meta_info({"meta_info": case["meta"]}).tolist()}))
    """)
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "case.json")], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, r.stderr[-3000:]
    got = json.loads(line[0][len("RESULT "):])
    assert got["asked"] is True and got["ids"] == routed(out[0]).flatten().tolist()
