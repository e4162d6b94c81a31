"""GenerateContext: identical requests issued together go to the engine as one request with n."""

import asyncio

import pytest

from rlx.config import SamplingConfig
from rlx.rollout.context import GenerateContext
from rlx.rollout.engines.client import EngineError, GenerateResult


class Client:
    """An engine client that answers each request with one result per sample, the sample's ids telling which
    request and which sample it was; `hold` keeps requests waiting until set."""

    def __init__(self, error: Exception | None = None, short: bool = False):
        self.requests, self.error, self.short = [], error, short
        self.hold: asyncio.Event | None = None
        self.cancelled = 0

    async def generate(self, req, *, retries=0):
        self.requests.append(req)
        k = len(self.requests)
        try:
            if self.hold is not None:
                await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        n = req.sampling_params.get("n", 1) - (1 if self.short else 0)
        return [GenerateResult(text="", output_ids=[k, i], output_logprobs=[-0.1, -0.2], finish_reason="length",
                               matched_stop=None, weight_version="1", token_weight_versions=[],
                               prompt_tokens=len(req.input_ids), rid=req.rid, raw={}) for i in range(n)]


def ctx(client, coalesce=True):
    return GenerateContext(client, None, SamplingConfig(max_new_tokens=2), coalesce=coalesce)  # type: ignore[arg-type]


P = {"max_new_tokens": 2, "temperature": 1.0}


def test_identical_requests_issued_together_go_as_one_request_with_n():
    """Three samples of one prompt, one of another prompt, one of the first prompt at another temperature: three
    requests. The three go as one with n=3 and no rid (SGLang gives each of n samples its own), each caller gets
    its own sample, in order; a lone request keeps its rid. A request issued later is not joined."""
    c = Client()
    g = ctx(c)

    async def run():
        together = await asyncio.gather(*(g.generate([5, 6, 7], dict(P), f"s{i}-{i}") for i in range(3)),
                                        g.generate([5, 6, 8], dict(P), "s3-3"),
                                        g.generate([5, 6, 7], {**P, "temperature": 0.5}, "s4-4"))
        later = await g.generate([5, 6, 7], dict(P), "s5-5")
        return together, later

    together, later = asyncio.run(run())
    first, second, third = c.requests[:3]
    assert first.input_ids == [5, 6, 7] and first.sampling_params == {**P, "n": 3} and first.rid is None
    assert second.sampling_params == P and second.rid == "s3-3"
    assert third.sampling_params == {**P, "temperature": 0.5} and third.rid == "s4-4"
    assert [r.output_ids for r in together] == [[1, 0], [1, 1], [1, 2], [2, 0], [3, 0]]
    assert [r.temperature for r in together] == [1.0, 1.0, 1.0, 1.0, 0.5]
    assert len(c.requests) == 4 and c.requests[3].rid == "s5-5" and later.output_ids == [4, 0]
    assert g._together == {}


def test_without_coalescing_every_call_is_its_own_request():
    c = Client()
    g = ctx(c, coalesce=False)

    async def run():
        return await asyncio.gather(*(g.generate([5, 6, 7], dict(P), f"s{i}-{i}") for i in range(3)))

    asyncio.run(run())
    assert [r.rid for r in c.requests] == ["s0-0", "s1-1", "s2-2"] and all("n" not in r.sampling_params
                                                                         for r in c.requests)


@pytest.mark.parametrize("short", [False, True])
def test_a_failed_joint_request_fails_every_caller(short):
    """An engine error, or fewer samples than asked, reaches each caller of the joint request."""
    c = Client(error=None if short else EngineError("HTTP 500: boom", 500), short=short)
    g = ctx(c)

    async def run():
        return await asyncio.gather(*(g.generate([5, 6], dict(P)) for _ in range(3)), return_exceptions=True)

    out = asyncio.run(run())
    assert len(c.requests) == 1 and all(isinstance(e, EngineError) for e in out)
    assert ("asked for 3 samples of one prompt (n), the engine answered 2" if short else "boom") in str(out[0])


def test_the_joint_request_goes_on_while_one_caller_waits_and_stops_when_none_does():
    c = Client()
    g = ctx(c)

    async def run():
        c.hold = asyncio.Event()
        calls = [asyncio.ensure_future(g.generate([5, 6], dict(P))) for _ in range(3)]
        await asyncio.sleep(0.01)
        calls[0].cancel()
        await asyncio.sleep(0.01)
        assert c.cancelled == 0  # two still wait
        c.hold.set()
        done = await asyncio.gather(*calls[1:])
        assert [r.output_ids for r in done] == [[1, 1], [1, 2]]

        c.hold = asyncio.Event()
        calls = [asyncio.ensure_future(g.generate([7, 8], dict(P))) for _ in range(2)]
        await asyncio.sleep(0.01)
        for t in calls:
            t.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert c.cancelled == 1  # nobody waits: the request to the engine is cancelled

    asyncio.run(run())


def test_an_id_outside_the_vocabulary_is_never_sent():
    """SGLang 0.5.23 dies whole on one (an IndexError in its embedding): the context refuses it, naming where."""
    c = Client()
    g = GenerateContext(c, None, SamplingConfig(max_new_tokens=2), vocab_size=10)  # type: ignore[arg-type]
    for ids, where in (([1, 10, 2], r"input_ids\[1\] = 10"), ([-1], r"input_ids\[0\] = -1")):
        with pytest.raises(ValueError, match=rf"{where} is outside the model's vocabulary \[0, 10\)"):
            asyncio.run(g.generate(ids, dict(P)))
    assert not c.requests
    asyncio.run(g.generate([0, 9], dict(P)))
    assert len(c.requests) == 1


def test_under_run_deterministic_each_request_carries_a_seed_from_its_sample_and_position():
    """With a seed (run.deterministic), a request whose rid came from new_rid carries sampling_seed =
    request_seed(seed, sample id, tokens so far): two samples of one prompt get different seeds (and so go as two
    requests, not one with n), a sample's next turn another one, and the same numbers come again in another run.
    Without the seed, nothing is added."""
    from rlx.rollout.context import request_seed
    from rlx.types import Sample

    def run(seed):
        c = Client()
        g = GenerateContext(c, None, SamplingConfig(max_new_tokens=2), coalesce=True, seed=seed)  # type: ignore[arg-type]
        a, b = Sample(prompt_ids=[5, 6, 7], sample_id=3), Sample(prompt_ids=[5, 6, 7], sample_id=4)

        async def go():
            await asyncio.gather(g.generate([5, 6, 7], dict(P), g.new_rid(a)), g.generate([5, 6, 7], dict(P), g.new_rid(b)))
            await g.generate([5, 6, 7, 1, 2, 9], dict(P), g.new_rid(a))
            await g.generate([5, 6, 7], dict(P), "someone-elses-rid")

        asyncio.run(go())
        return [r.sampling_params.get("sampling_seed") for r in c.requests]

    seeds = run(11)
    assert seeds == [request_seed(11, 3, 3), request_seed(11, 4, 3), request_seed(11, 3, 6), None]
    assert len(set(seeds[:3])) == 3 and run(11) == seeds and run(12)[:3] != seeds[:3]
    assert all(0 <= s < 2**63 for s in seeds[:3])
    assert run(None) == [None] * 3  # and the two samples of one prompt go as one request with n


def test_with_adapter_pushes_every_request_names_the_served_adapter_and_its_tokens_get_its_version():
    """A request names the adapter served when it is sent and keeps it: its tokens are that version's, whatever the
    engine reports; before any push, the base model's (version 0). Copies of the context share the served adapter."""
    import dataclasses

    from rlx.rollout.context import ServedAdapter

    c = Client()
    g = GenerateContext(c, None, SamplingConfig(max_new_tokens=2), adapter=ServedAdapter(on=True))  # type: ignore[arg-type]
    copy = dataclasses.replace(g)

    async def run():
        base = await copy.generate([5], dict(P))
        g.adapter.name, g.adapter.version = "actor-v3", 3
        c.hold = asyncio.Event()
        call = asyncio.ensure_future(copy.generate([5], dict(P)))
        while len(c.requests) < 2:  # (sent)
            await asyncio.sleep(0)
        g.adapter.name, g.adapter.version = "actor-v4", 4  # a push while it runs
        c.hold.set()
        return base, await call

    base, adapted = asyncio.run(run())
    assert [r.lora_path for r in c.requests] == [None, "actor-v3"]
    assert (base.lora_path, base.token_weight_versions) == (None, ["0", "0"])
    assert (adapted.lora_path, adapted.weight_version, adapted.token_weight_versions) == ("actor-v3", "3", ["3", "3"])


def test_each_multi_lora_sample_names_its_own_adapter_and_identical_prompts_of_two_adapters_stay_apart():
    """Multi-LoRA: `for_sample` gives a sample's requests its adapter (``Sample.lora``), whose version its tokens get;
    identical requests of two adapters issued together are two requests (coalescing joins one adapter's only); a
    sample of no adapter is the base model's; an adapter the engines are not given is an error naming it."""
    from rlx.rollout.context import ServedAdapter, for_sample
    from rlx.types import Sample

    c = Client()
    add, sub = ServedAdapter(on=True, name="add-v2-aa", version=2), ServedAdapter(on=True, name="sub-v2-bb", version=2)
    g = GenerateContext(c, None, SamplingConfig(max_new_tokens=2), coalesce=True,  # type: ignore[arg-type]
                        adapters={"add": add, "sub": sub})

    async def run():
        return await asyncio.gather(*(for_sample(g, Sample([5], lora=lora)).generate([5, 6], dict(P))
                                      for lora in ("add", "add", "sub", None)))

    results = asyncio.run(run())
    assert sorted((r.lora_path or "", r.sampling_params.get("n", 1)) for r in c.requests) == [
        ("", 1), ("add-v2-aa", 2), ("sub-v2-bb", 1)]
    assert [r.lora_path for r in results] == ["add-v2-aa", "add-v2-aa", "sub-v2-bb", None]
    assert [r.token_weight_versions for r in results[:3]] == [["2", "2"]] * 3
    assert add.users == sub.users == {}  # released once answered
    with pytest.raises(Exception, match="adapter 'mul'"):
        for_sample(g, Sample([5], lora="mul"))
