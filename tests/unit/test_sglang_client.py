"""rlx's side of SGLang's API without a server: per-token versions from spans, weight verification by what
each engine serves, device names in tensor payloads, the memory-saver flag. (SGLang's own side of these is
checked in tests/integration/test_sglang_code.py.)"""

import asyncio

import pytest
import torch

from rlx.config import parse_config
from rlx.errors import RLXError
from rlx.orchestrate.ranks import weight_target
from rlx.rollout.engines.client import EngineError, GenerateRequest
from rlx.rollout.engines.fleet import EngineFleet
from rlx.transport import verify as V
from rlx.transport.group import engine_ranks
from rlx.transport.payloads import WireError, _device_index
from rlx.transport.verify import Fingerprints
from rlx.types import GenerateResult, token_versions


def test_a_generate_body_names_only_what_was_asked_and_is_its_own_copy():
    """/generate's body: SGLang's field names (checked against SGLang's GenerateReqInput in test_sglang_code);
    ``rid`` only when given, ``return_routed_experts`` only when asked (servers before 0.5.6 refuse it); a body
    changed afterwards (by a caller adding ``stream``) leaves the request as it was."""
    req = GenerateRequest([5, 6], {"max_new_tokens": 3, "stop": ["\\n"]})
    body = req.to_json()
    assert body == {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "stop": ["\\n"]},
                    "return_logprob": True}
    body["input_ids"].append(7)
    body["sampling_params"]["n"] = 2
    body["sampling_params"]["stop"].append("x")
    assert req.input_ids == [5, 6] and req.sampling_params == {"max_new_tokens": 3, "stop": ["\\n"]}
    both = GenerateRequest([1], {}, False, rid="s3-0", return_routed_experts=True).to_json()
    assert both == {"input_ids": [1], "sampling_params": {}, "return_logprob": False, "rid": "s3-0",
                    "return_routed_experts": True}


def test_token_versions_from_sglang_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == ["3", "3", "4", "4", "4"]
    assert token_versions([{"version": "3", "start": 0, "end": 0}], 0) == []
    assert token_versions(None, 3) == []  # 0.5.5: one version per result
    assert token_versions(spans, 4) == []  # spans that do not cover the tokens are not trusted
    res = GenerateResult.from_json({"text": "", "output_ids": [1, 2, 3], "meta_info": {
        "weight_version": "4", "weight_versions": spans[:1] + [{"version": "4", "start": 2, "end": 3}],
        "finish_reason": {"type": "length", "length": 3}}})
    assert res.token_weight_versions == ["3", "3", "4"] and res.finish_reason == "length"


def test_engine_ranks_count_every_tp_rank():
    assert engine_ranks([1]) == ([1], 2)
    assert engine_ranks([2, 1, 4]) == ([1, 3, 4], 8)
    with pytest.raises(ValueError):
        engine_ranks([0])


def test_payload_devices_named_by_uuid_map_to_a_local_gpu_or_fail_clearly():
    assert _device_index(1) == 1
    with pytest.raises(WireError, match="no GPU with UUID GPU-0000"):
        _device_index("GPU-0000")


def test_offloading_sglang_engines_get_the_memory_saver(tmp_path):
    text = "model: {path: /m}\nray: {gpus_per_engine: 1}\nrollout: {engines: [{backend: sglang}], offload_during_train: %s}"
    on = EngineFleet(parse_config(text % "true"), tmp_path)._command(parse_config(text % "true").rollout.engines[0],
                                                                    "127.0.0.1", 1)
    off_cfg = parse_config(text % "false")
    off = EngineFleet(off_cfg, tmp_path)._command(off_cfg.rollout.engines[0], "127.0.0.1", 1)
    assert "--enable-memory-saver" in on and "--enable-memory-saver" not in off


class FakeEngine:
    """An engine answering the verification calls from a table of routes (a missing route: 404)."""

    def __init__(self, url, version="1", by_name=None, checker=None):
        self.url, self.version, self.by_name, self.checker = url, version, by_name, checker
        self.calls = []

    def client(self, timeout_s=60):
        engine = self

        class C:
            async def __aenter__(self):
                return self

            async def __aexit__(self, *exc):
                pass

            async def weight_version(self):
                return engine.version

            async def get_weights_by_name(self, name, n):
                engine.calls.append(("by_name", name))
                if engine.by_name is None:
                    raise EngineError("Get parameter by name failed", 400)
                return engine.by_name[name]

            async def weights_checker(self):
                engine.calls.append(("checker",))
                if engine.checker is None:
                    raise EngineError("not found", 404)
                return {"success": True, "ranks": [{"parallelism_info": [{"tp_rank": 0}]}],
                        "per_engine_checksum": engine.checker}

        return C()


def prints_of(tensors):
    p = Fingerprints(values=4)
    for _ in p.watch(iter(tensors.items())):
        pass
    return p


@pytest.fixture(autouse=True)
def fresh_verify_state():
    V._WARNED.clear()
    V._NO_BY_NAME.clear()
    V._LAST_CHECKER.clear()


def test_verify_reads_sglang_rows_by_name(capsys):
    tensors = {"a": torch.arange(12.0).view(3, 4), "b": torch.ones(5)}
    prints = prints_of(tensors)
    rows = {"a": [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]], "b": [1.0] * 5}  # SGLang: rows at full width
    asyncio.run(V.verify([FakeEngine("e", by_name=rows)], prints, 1))
    wrong = {"a": [[0.0, 1.0, 2.5, 3.0]], "b": [1.0] * 5}
    with pytest.raises(RLXError, match="serves different values for 'a'"):
        asyncio.run(V.verify([FakeEngine("e2", by_name=wrong)], prints, 1))
    with pytest.raises(RLXError, match="reports weight version '0', expected 1"):
        asyncio.run(V.verify([FakeEngine("e3", version="0", by_name=rows)], prints, 1))


def test_verify_falls_back_to_the_version_with_one_warning(capsys):
    prints = prints_of({"a": torch.ones(3)})
    engine = FakeEngine("qwen-on-0.5.5")  # no get_weights_by_name for the model, no weights_checker
    for _ in range(2):
        asyncio.run(V.verify([engine], prints, 1))
    err = capsys.readouterr().err
    assert err.count("checking the version only") == 1
    assert engine.calls.count(("by_name", "a")) == 1  # not asked again once it said it cannot


def test_verify_with_sglangs_weights_checker(capsys):
    first, second = prints_of({"a": torch.ones(3)}), prints_of({"a": torch.full((3,), 2.0)})
    e1, e2 = FakeEngine("e1", checker="x1"), FakeEngine("e2", checker="x1")
    asyncio.run(V.verify([e1, e2], first, 1))
    e2.checker = "y"
    with pytest.raises(RLXError, match="same layout hold different weights"):
        asyncio.run(V.verify([e1, e2], second, 1))
    V._LAST_CHECKER.clear()
    asyncio.run(V.verify([e1], first, 1))
    with pytest.raises(RLXError, match="holds the same weights as before"):  # a push it ignored
        asyncio.run(V.verify([e1], second, 2 - 1))
    assert "weights_checker" in capsys.readouterr().err


def test_fingerprints_hash_heads_in_the_served_dtype():
    t = torch.randn(10)
    p = Fingerprints(values=4, plans=[{"a": "bfloat16"}])
    list(p.watch(iter([("a", t)])))
    from rlx.transport.payloads import tensor_hash

    assert p.head_hashes[("a", "bfloat16")] == tensor_hash(t[:4], torch.bfloat16)
    assert p.hashes == {}  # whole tensors only for a full check


def test_a_sender_asks_each_engine_its_dtypes_once_per_setup(monkeypatch, tmp_path):
    """Verification needs each engine's dtype per tensor (its checksum route). That is set by how the engine was
    launched: asked at the first push after a setup, not at every push (one HTTP round trip of the push's
    seven); a setup (engines changed, one restarted) asks again."""
    from types import SimpleNamespace as NS

    from rlx.transport import sender

    asked, seen = [], []

    async def served(engines):
        asked.append([e.url for e in engines])
        return {e.url: {"w": "float32"} for e in engines}

    async def check(engines, prints, version, dtypes, full):
        seen.append(dict(dtypes))

    async def nothing(*a):
        pass

    async def tp_sizes(engines):
        return [1] * len(engines)

    monkeypatch.setattr(sender, "_tp_sizes", tp_sizes)
    monkeypatch.setattr(sender, "served_dtypes", served)
    monkeypatch.setattr(sender, "verify", check)
    s = sender.WeightSender(NS(par=NS(sender=True, pp=1, pp_rank=0, rank=0, gathers=False),
                               hf_tensors=lambda: iter([("w", torch.ones(2))])), plugins=None, transport_spec=None,
                               engine_for=lambda url: weight_target(url, 600))
    monkeypatch.setattr(s, "_agree", lambda fn, *a: fn(*a))
    monkeypatch.setattr(s, "_setup_transport", lambda: setattr(s, "transport", NS(send=nothing, commit=nothing)))
    s.setup(["http://a", "http://b"], str(tmp_path), "127.0.0.1")
    for version in (1, 2, 3):
        s.push(version)
    assert asked == [["http://a", "http://b"]]
    assert seen == [{"http://a": {"w": "float32"}, "http://b": {"w": "float32"}}] * 3
    s.setup(["http://a"], str(tmp_path), "127.0.0.1")  # b was taken out
    s.push(4)
    assert asked == [["http://a", "http://b"], ["http://a"]] and seen[-1] == {"http://a": {"w": "float32"}}


def test_a_session_that_fails_to_open_on_one_engine_is_closed_on_the_others():
    """`update_sessions` opens SGLang's weight-update session on every engine. If one engine fails to open
    (it died), the sessions already open elsewhere are closed before the error goes up: a push sent again to the
    engines that serve would otherwise meet 'a weight update session is already open' (HTTP 400)."""
    from contextlib import asynccontextmanager
    from types import SimpleNamespace as NS

    from rlx.transport import update_sessions

    calls = []

    def engine(url, fails=False):
        async def begin():
            calls.append(("begin", url))
            if fails:
                raise EngineError(f"engine at {url} unreachable")
            return True

        async def end():
            calls.append(("end", url))

        @asynccontextmanager
        async def client():
            yield NS(begin_weight_update=begin, end_weight_update=end)

        return NS(url=url, client=client)

    async def push(engines):
        async with update_sessions(engines):
            calls.append(("send", None))

    with pytest.raises(EngineError, match="b unreachable"):
        asyncio.run(push([engine("a"), engine("b", fails=True), engine("c")]))
    assert sorted(calls) == [("begin", "a"), ("begin", "b"), ("begin", "c"), ("end", "a"), ("end", "c")]
    calls.clear()
    asyncio.run(push([engine("a"), engine("c")]))
    assert calls == [("begin", "a"), ("begin", "c"), ("send", None), ("end", "a"), ("end", "c")]


def test_the_senders_loop_leaves_nothing_of_a_failed_call_running_and_closes_old_engines_clients(tmp_path):
    """The weight sender keeps one event loop (and kept-open clients on it). As asyncio.run would, each call
    cancels what it left running (another engine's upload of a gather that failed on one), so nothing of a failed
    push runs on at the next call. A new setup closes the old transport first, then the clients of the engines it
    pointed to, those the old transport's close opened included."""
    from types import SimpleNamespace as NS

    from rlx.transport import sender

    s = sender.WeightSender(NS(par=NS(sender=False, pp=1, pp_rank=0, rank=0, world=1, gathers=False)),
                            plugins=None, transport_spec=None, engine_for=lambda url: weight_target(url, 600))
    slow_done = []

    async def slow():
        await asyncio.sleep(0.2)
        slow_done.append(1)

    async def failing():
        async def boom():
            raise EngineError("HTTP 500 from one engine", 500)

        await asyncio.gather(slow(), boom())

    with pytest.raises(EngineError):
        s.run(failing())
    assert slow_done == [] and not asyncio.all_tasks(s.loop)  # cancelled, not left to finish at the next call

    events = []

    class Transport:
        def __init__(self, ctx=None):
            self.ctx = ctx

        async def setup(self, ctx):
            self.ctx = ctx

        async def close(self):
            for e in self.ctx.engines:
                e.client()  # a transport that tells its engines goodbye
            events.append("transport closed")

    s.par.sender = True
    s.plugins = NS(build=lambda kind, spec: Transport())
    s._agree = lambda fn, *a: fn(*a)

    async def tp_sizes(engines):
        return [1] * len(engines)

    sender._tp_sizes, real = tp_sizes, sender._tp_sizes
    try:
        s.setup(["http://a"], str(tmp_path), "127.0.0.1")
        old = s.ctx.engines[0]
        s.setup(["http://b"], str(tmp_path), "127.0.0.1")
        assert events == ["transport closed"] and old._clients == {}
        s.close()
        assert s.loop.is_closed() and s.ctx.engines[0]._clients == {}
    finally:
        sender._tp_sizes = real
