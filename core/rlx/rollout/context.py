"""What a generator gets to work with: the engine client, the tokenizer and the sampling settings.

A generator is a component registered through ``register_generators``: a class with ``name`` and
``async generate(ctx, sample) -> list[Sample]``. It receives a sample whose ``prompt_ids`` are set
(and, when a partial rollout resumes, whose ``response_ids`` already hold the earlier tokens), and
returns the finished sample, or several when it branches (subagents, compaction). It must keep
token-in-token-out: ``response_ids`` are the engine's ids, appended, never re-encoded from text.
Rewards are scored by the manager afterwards unless the generator has already set ``sample.reward``.

Identical requests issued together (the samples of a group, each asking for the same prompt with the same
sampling parameters in the same turn of the event loop) go to the engine as one request with ``n`` set to
their count (``rollout.requests.coalesce``): SGLang prefills the prompt once and samples n continuations, and
the HTTP work is a group's, not a sample's. Each caller still gets its own result, as if it had asked alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from rlx.config import SamplingConfig
from rlx.errors import RLXError
from rlx.rollout.engines.client import EngineClient, EngineError, GenerateRequest, GenerateResult
from rlx.rollout.engines.health import resendable
from rlx.types import Sample, SampleStatus

_FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class RequestGate:
    """Lets generate requests through, or holds new ones while those in flight finish (an async weight
    swap with ``train.async.swap: drain``)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0

    async def __aenter__(self) -> None:
        await self._open.wait()
        self.in_flight += 1
        self._idle.clear()

    async def __aexit__(self, *exc: Any) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self) -> None:
        """Stop admitting requests and wait until none is in flight."""
        self._open.clear()
        await self._idle.wait()

    def reopen(self) -> None:
        self._open.set()


@dataclass
class ServedAdapter:
    """The LoRA adapter the engines serve the policy with (``train.lora.push: adapter``), set after each push: every
    request names it (``lora_path``), and its tokens get its version (a request keeps the adapter it started with,
    whatever pushes come while it runs, unless it is sent again after an engine failed: then with the newest). It
    counts the requests in flight per adapter, so that an older adapter is unloaded once none uses it (`unused`).
    One object shared by every copy of a context."""

    on: bool = False  # pushes are adapters: a request naming none is the base model's, version 0
    name: str | None = None  # None: the base model (before the first push)
    version: int = 0
    users: dict[str, int] = field(default_factory=dict)  # requests in flight per adapter
    _idle: dict[str, asyncio.Event] = field(default_factory=dict)

    def hold(self, name: str | None) -> None:
        if name is not None:
            self.users[name] = self.users.get(name, 0) + 1

    def release(self, name: str | None) -> None:
        if name is None:
            return
        self.users[name] -= 1
        if self.users[name] <= 0:
            del self.users[name]
            if (idle := self._idle.pop(name, None)) is not None:
                idle.set()

    async def unused(self, name: str) -> None:
        """Return once no request in flight names adapter `name`."""
        if name in self.users:
            await self._idle.setdefault(name, asyncio.Event()).wait()


@dataclass
class GenerateContext:
    client: EngineClient  # the router, or the single engine
    tokenizer: Any
    sampling: SamplingConfig
    retries: int = 0  # retries of a request that failed on a dead or unreachable engine
    gate: RequestGate = field(default_factory=RequestGate)
    context_length: int | None = None  # the engines' context length, when they report one
    health: Any = None  # the fleet's FleetHealth (rollout.fault_tolerance): failed requests are sent again
    routed_experts: bool = False  # ask engines for the experts each token was routed to (routing replay)
    coalesce: bool = False  # identical requests issued together go as one with n (rollout.requests.coalesce)
    vocab_size: int | None = None  # the model's embedding rows: an id outside them is never sent (SGLang dies)
    seed: int | None = None  # run.seed under run.deterministic: every request gets a sampling_seed (`request_seed`)
    adapter: ServedAdapter = field(default_factory=ServedAdapter)  # the LoRA adapter requests name
    adapters: dict[str, ServedAdapter] = field(default_factory=dict)  # multi-LoRA's, by name (`for_sample`)
    _rids: Any = field(default_factory=itertools.count)
    _rid_samples: dict[str, int] = field(default_factory=dict)  # rid -> sample id, until the request is sent
    _together: dict[Any, _Together] = field(default_factory=dict)  # requests gathering this turn of the loop

    def sampling_params(self, already: int = 0, **overrides: Any) -> dict[str, Any]:
        """SGLang sampling_params from config, with `already` tokens deducted from the budget."""
        s = self.sampling
        params = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
                  "max_new_tokens": max(s.max_new_tokens - already, 0), "stop": list(s.stop),
                  "stop_token_ids": list(s.stop_token_ids), "skip_special_tokens": True}
        if s.ignore_eos:
            params["ignore_eos"] = True
        return params | overrides

    def new_rid(self, sample: Sample) -> str:
        rid = f"s{sample.sample_id}-{next(self._rids)}"
        if self.seed is not None:
            self._rid_samples[rid] = sample.sample_id
        return rid

    async def generate(self, input_ids: list[int], params: dict[str, Any], rid: str | None = None) -> GenerateResult:
        """One generation. Within the context length: SGLang refuses (400) a prompt that fills the context
        and a ``max_new_tokens`` that would run past it, so the budget is cut to what fits, and a prompt with
        no room left finishes at once with ``length`` and no tokens (a multi-turn sample that grew to the
        limit), as the rest of rlx expects of a truncated sample. An id outside the vocabulary is a ValueError
        here: SGLang 0.5.23's whole server dies on one (an IndexError in its embedding)."""
        sample_id = self._rid_samples.pop(rid, None) if rid is not None else None
        if sample_id is not None and self.seed is not None and "sampling_seed" not in params:
            params = {**params, "sampling_seed": request_seed(self.seed, sample_id, len(input_ids))}
        # min/max run in C: an agent's 60k-token prompt is checked in well under a millisecond
        if self.vocab_size is not None and input_ids and (min(input_ids) < 0 or max(input_ids) >= self.vocab_size):
            bad = next(i for i, t in enumerate(input_ids) if not 0 <= t < self.vocab_size)
            raise ValueError(f"input_ids[{bad}] = {input_ids[bad]} is outside the model's vocabulary "
                             f"[0, {self.vocab_size}); not sent to the engine")
        if self.context_length is not None:
            # one token short of the limit: SGLang 0.5.5 refuses prompt + max_new_tokens == context, 0.5.23 not
            room = self.context_length - len(input_ids) - 1
            if room <= 0:
                return GenerateResult(text="", output_ids=[], output_logprobs=[], finish_reason="length",
                                      matched_stop=None, weight_version="", token_weight_versions=[],
                                      prompt_tokens=len(input_ids), rid=rid, raw={},
                                      temperature=float(params.get("temperature", 1.0)))
            if params.get("max_new_tokens") is not None and params["max_new_tokens"] > room:
                params = {**params, "max_new_tokens": room}
        req = GenerateRequest(input_ids, params, True, rid, self.routed_experts)  # (its adapter: `_send`)
        if self.coalesce and params.get("n", 1) == 1:
            res = await self._join(req)
        else:
            async with self.gate:
                res = (await self._send(req))[0]
        res.temperature = float(params.get("temperature", 1.0))
        if self.adapter.on:  # every token is the adapter's, whichever version the engine has moved to since
            res.lora_path, res.weight_version = req.lora_path, str(req.lora_version)
            res.token_weight_versions = [str(req.lora_version)] * len(res.output_ids)
        return res

    async def _join(self, req: GenerateRequest) -> GenerateResult:
        """`req`'s result, from one request with the identical requests issued in this turn of the event loop."""
        key = (tuple(req.input_ids), json.dumps(req.sampling_params, sort_keys=True), id(self.adapter))
        batch = self._together.get(key)
        if batch is None:
            loop = asyncio.get_running_loop()
            batch = self._together[key] = _Together(loop.create_future())
            loop.call_soon(self._launch, key)  # after the callers already scheduled in this turn have asked
        i = len(batch.requests)
        batch.requests.append(req)
        batch.waiting += 1
        try:
            return (await asyncio.shield(batch.results))[i]
        except asyncio.CancelledError:
            batch.waiting -= 1
            if not batch.waiting and batch.task is not None:  # nobody wants it any more: free the engine
                batch.task.cancel()
            raise

    def _launch(self, key: Any) -> None:  # the key identical requests share (`_together`)
        batch = self._together.pop(key)
        if batch.waiting:
            batch.task = asyncio.ensure_future(self._send_together(batch))
        else:
            batch.results.cancel()

    async def _send_together(self, batch: _Together) -> None:
        reqs = batch.requests
        one = reqs[0] if len(reqs) == 1 else GenerateRequest(
            reqs[0].input_ids, {**reqs[0].sampling_params, "n": len(reqs)}, True, None, self.routed_experts)
        try:
            async with self.gate:
                results = await self._send(one)
            for r in reqs:  # (the adapter it was last sent with)
                r.lora_path, r.lora_version = one.lora_path, one.lora_version
            if len(results) != len(reqs):
                raise EngineError(f"asked for {len(reqs)} samples of one prompt (n), the engine answered "
                                  f"{len(results)}")
        except asyncio.CancelledError:
            batch.results.cancel()
            raise
        except Exception as e:  # each caller gets it
            if not batch.results.done():
                batch.results.set_exception(e)
                batch.results.exception()  # read: callers that went away leave no "never retrieved" warning
            return
        if not batch.results.done():
            batch.results.set_result(results)

    async def _send(self, req: GenerateRequest) -> list[GenerateResult]:
        """Send `req` (one result per sample); with fault tolerance, send it again (from the same tokens:
        nothing of a failed request is kept) when its engine failed, once an engine serves, at most
        ``max_resends`` times. With LoRA adapters, the request names the adapter served as it leaves (not when it was
        made: it may have waited out a swap) and holds it until answered; sent again, it names the one served then
        (the engine it goes to may have only that one: a restarted engine)."""
        if self.adapter.on:
            req.lora_path, req.lora_version = self.adapter.name, self.adapter.version
        self.adapter.hold(req.lora_path)
        try:
            return await self._send_resending(req)
        finally:
            self.adapter.release(req.lora_path)

    async def _send_resending(self, req: GenerateRequest) -> list[GenerateResult]:
        if self.health is None:
            return await self.client.generate(req, retries=self.retries)
        resends = 0
        while True:
            await self.health.wait_serving()
            call = asyncio.ensure_future(self.client.generate(req, retries=self.retries))
            try:
                while not call.done():
                    down = self.health.next_down()
                    await asyncio.wait({call, down}, return_when=asyncio.FIRST_COMPLETED)
                    if not call.done() and down.result():  # an attached engine went: this may hang on it
                        call.cancel()
                        await asyncio.wait({call})
                        if call.cancelled():
                            await self._abort_everywhere(req.rid)
                        break
            except BaseException:
                call.cancel()
                raise
            error: EngineError
            if call.cancelled():
                error = EngineError("an attached engine was taken out while the request was in flight")
            else:
                try:
                    return call.result()
                except EngineError as e:
                    if not resendable(e):
                        raise
                    error = e
            if resends >= self.health.cfg.max_resends:
                raise EngineError(f"a generate request failed {resends + 1} times on failing engines "
                                  f"(rollout.fault_tolerance.max_resends {self.health.cfg.max_resends}); "
                                  f"last: {error}", error.status)
            resends += 1
            self.health.counts["rollout/resent_requests"] += 1
            await self.health.settle()
            if req.lora_path != self.adapter.name:
                self.adapter.release(req.lora_path)
                req.lora_path, req.lora_version = self.adapter.name, self.adapter.version
                self.adapter.hold(req.lora_path)

    async def _abort_everywhere(self, rid: str | None) -> None:
        """Abort `rid` on every serving engine (the one that has it, if any, frees its slot). A joint request
        (n > 1) has no rid to abort: SGLang names its samples itself."""
        if rid is None:
            return
        try:
            await self.health.fleet.for_each(lambda c: c.abort(rid))
        except EngineError:
            pass  # best effort: an engine that cannot be reached is not running it either


@dataclass
class _Together:
    """Identical generate requests sent as one: their callers (in order), and the engine's results."""

    results: asyncio.Future
    requests: list[GenerateRequest] = field(default_factory=list)
    waiting: int = 0  # callers still waiting
    task: asyncio.Task | None = None


def for_sample(ctx: GenerateContext, sample: Sample) -> GenerateContext:
    """`ctx`, with the sampling the sample's row asks for (its ``metadata.sampling``, `rlx.data.datasets`) over
    the run's, and naming the sample's own adapter (multi-LoRA: `Sample.lora`)."""
    if sample.lora is not None:
        if sample.lora not in ctx.adapters:
            raise RLXError(f"sample {sample.sample_id} is adapter {sample.lora!r}'s, which these engines are not "
                           f"given (train.lora.adapters: {sorted(ctx.adapters) or 'none'})")
        ctx = dataclasses.replace(ctx, adapter=ctx.adapters[sample.lora])
    overrides = sample.metadata.get("sampling")
    if not overrides:
        return ctx
    return dataclasses.replace(ctx, sampling=SamplingConfig.model_validate({**ctx.sampling.model_dump(), **overrides}))


def request_seed(run_seed: int, sample_id: int, position: int) -> int:
    """The sampling seed of the request that continues sample `sample_id` from `position` tokens (prompt and response
    so far: a new number each turn), under ``run.deterministic``: from these alone, never from timing or engines."""
    digest = hashlib.blake2b(f"{run_seed}/{sample_id}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: SGLang holds it in an int64 tensor


def append_model_tokens(sample: Sample, res: GenerateResult) -> None:
    """Append what the engine sampled to the sample, with logprobs, mask 1, versions and temperature.

    An engine that reports no log-probs leaves the sample without any (``rollout_logprobs`` None), never
    with made-up zeros. The temperature recorded is that of the distribution the logprobs are of: the
    sampling temperature, or 1 for greedy decoding (engines report plain log-probs then).
    """
    n = len(res.output_ids)
    sample.response_ids += res.output_ids
    if sample.rollout_logprobs is not None and len(res.output_logprobs) == n:
        sample.rollout_logprobs += res.output_logprobs
    else:
        sample.rollout_logprobs = None
    t = res.temperature if res.temperature and res.temperature > 0 else 1.0
    sample.token_temperatures = _padded(sample.token_temperatures, len(sample.loss_mask)) + [t] * n
    sample.loss_mask += [1] * n
    versions = res.token_weight_versions or [res.weight_version] * len(res.output_ids)
    sample.token_versions += [_int_version(v) for v in versions]
    if sample.token_versions:
        sample.weight_version = min(sample.token_versions)
    sample.finish_reason = res.finish_reason
    sample.status = _FINISH_STATUS.get(res.finish_reason, SampleStatus.COMPLETED)
    # The engine's routing covers the whole request, prompt + output - 1 tokens; a request sent with the
    # sample's ids so far (every rlx generator does) then covers the sample up to its last token.
    if res.routed_experts is not None:
        sample.routed_experts = res.routed_experts
    if res.lora_path is not None:
        sample.adapter = res.lora_path
    if res.spec is not None:  # (verify steps, drafts proposed, drafts accepted, tokens), over the sample's turns
        sample.metadata["speculative"] = [a + b for a, b in zip(sample.metadata.get("speculative", (0, 0, 0, 0)),
                                                                res.spec, strict=True)]


def append_env_tokens(sample: Sample, ids: list[int]) -> None:
    """Append tokens the model did not sample (a tool result, a user turn): mask 0, logprob 0.

    They carry the version of the model token before them, so that per-token lists stay aligned.
    """
    sample.token_temperatures = _padded(sample.token_temperatures, len(sample.loss_mask)) + [1.0] * len(ids)
    sample.response_ids += ids
    if sample.rollout_logprobs is not None:
        sample.rollout_logprobs += [0.0] * len(ids)
    sample.loss_mask += [0] * len(ids)
    sample.token_versions += [sample.token_versions[-1] if sample.token_versions else sample.weight_version] * len(ids)


def _padded(values: list[float], n: int) -> list[float]:
    """`values` made `n` long with 1.0 (samples from before temperatures were recorded)."""
    return values + [1.0] * (n - len(values)) if len(values) < n else values


def _int_version(v: str) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0  # SGLang's initial version is "default"
