"""The embedded engine's HTTP server: SGLang's native API over a `Scheduler`, on 127.0.0.1.

Routes, request fields and response shapes follow SGLang's ``http_server.py`` so that the client,
router and everything above them run unchanged against either engine. Every response carries the
engine's weight version: in the JSON body where the body is an object (``weight_version``, and
``meta_info.weight_version`` for generations) and in the ``X-Weight-Version`` header everywhere.
Errors are ``{"error": {"message": ...}}`` with a 4xx for bad requests, as SGLang sends them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from rlx.rollout.engines.embedded import weights as W
from rlx.rollout.engines.embedded.answers import BadRequest, ContractError, error
from rlx.rollout.engines.embedded.sampling import SamplingParams
from rlx.rollout.engines.embedded.scheduler import Request, Scheduler
from rlx.rollout.engines.embedded.weight_routes import T, WeightRoutes

if TYPE_CHECKING:
    from rlx.types import JSON

_SAMPLING_KEYS = set(SamplingParams.__dataclass_fields__)
# Accepted for compatibility with SGLang clients; they do not change what this engine does.
_IGNORED_SAMPLING_KEYS = {"frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
                          "spaces_between_special_tokens", "json_schema", "regex",
                          "ebnf", "custom_params", "logit_bias"}


def weight_version_spans(versions: list[str], fallback: str) -> list[dict[str, Any]]:
    """SGLang's ``meta_info.weight_versions``: the weight version of each output token as contiguous spans
    ``{"version", "start", "end"}`` (half-open token ranges, adjacent spans differ), ``[{fallback, 0, 0}]``
    when no token was generated."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": fallback, "start": 0, "end": 0}]


class EngineServer(WeightRoutes):
    """SGLang's native API over `scheduler`: generation and the engine's state here, the weight routes in
    `WeightRoutes`."""

    def __init__(self, scheduler: Scheduler, *, model_path: str, served_model_name: str | None = None,
                 server_args: dict[str, Any] | None = None):
        self.s = scheduler
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.server_args = {k: v for k, v in (server_args or {}).items() if v is not None}
        self.tokenizer_path = self.server_args.get("tokenizer_path") or model_path
        self.started = time.time()
        self.groups: dict[str, W.BroadcastGroup] = {}  # weight-update groups by name (one per sending rank)
        self.session = False  # inside /begin_weight_update ... /end_weight_update
        self.app = web.Application(middlewares=[self._middleware], client_max_size=1 << 31)
        r = self.app.router
        r.add_post("/generate", self.generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health if path == "/health" else self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_route("*", "/weights_checker", self.weights_checker)
        r.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/weights_checksum", self.weights_checksum)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        r.add_post("/release_memory_occupation", self.release_memory)
        r.add_post("/resume_memory_occupation", self.resume_memory)

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        try:
            resp = await handler(request)
        except ContractError as e:
            resp = web.json_response({"error": str(e)}, status=400)
        except BadRequest as e:
            resp = error(400, str(e))
        except W.WireError as e:
            resp = web.json_response({"success": False, "message": str(e)}, status=400)
        except json.JSONDecodeError as e:
            resp = error(400, f"body is not valid JSON: {e}")
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:  # as SGLang's FastAPI words them
            resp = web.json_response({"detail": "Not Found" if e.status == 404 else "Method Not Allowed"},
                                     status=e.status)
        except web.HTTPException:
            raise
        except (TypeError, ValueError, KeyError) as e:
            resp = error(400, f"{type(e).__name__}: {e}")
        except Exception as e:
            resp = error(500, f"{type(e).__name__}: {e}")
        resp.headers["X-Weight-Version"] = self.s.weight_version
        return resp

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        body = await request.json()
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    async def _call(self, fn: Callable[[], T]) -> T:
        return await asyncio.to_thread(self.s.call, fn)

    # -- generation ------------------------------------------------------------------------------

    def _params(self, raw: JSON) -> SamplingParams:
        raw = raw or {}
        if not isinstance(raw, dict):
            raise BadRequest("sampling_params must be an object")
        unknown = sorted(set(raw) - _SAMPLING_KEYS - _IGNORED_SAMPLING_KEYS)
        if unknown:
            expected = ", ".join(f"`{k}`" for k in sorted(_SAMPLING_KEYS | _IGNORED_SAMPLING_KEYS))
            raise ContractError(f"unknown field `{unknown[0]}`, expected one of {expected}")
        p = SamplingParams(**{k: v for k, v in raw.items() if k in _SAMPLING_KEYS and v is not None})
        if isinstance(p.stop, str):
            p.stop = [p.stop]
        # SGLang 0.5.23's checks and words (SamplingParams.verify)
        if not math.isfinite(p.temperature) or p.temperature < 0:
            raise BadRequest(f"temperature must be a non-negative finite number, got {p.temperature}.")
        if not 0 < p.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {p.top_p}.")
        if not 0 <= p.min_p <= 1:
            raise BadRequest(f"min_p must be in [0, 1], got {p.min_p}.")
        if p.n < 1:
            raise BadRequest(f"n must be at least 1, got {p.n}.")
        if p.max_new_tokens is None or p.max_new_tokens < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
        return p

    def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            if not ids:
                raise BadRequest("input_ids cannot be empty.")
            single = isinstance(ids[0], int)
            batch = [ids] if single else ids
        elif body.get("text") is not None:
            text = body["text"]
            single = isinstance(text, str)
            batch = [self.s.tokenizer.encode(t, add_special_tokens=False) for t in ([text] if single else text)]
        else:
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        vocab = self.s.model.config.get_text_config().vocab_size
        for ids in batch:
            if not ids:
                raise BadRequest("input_ids cannot be empty.")
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise BadRequest(f"input_ids must be lists of ints in [0, {vocab})")
        return batch, single

    def _logprob_extras(self, body: dict[str, Any], prompts: list[list[int]]) -> list[dict[str, Any]]:
        """What ``return_logprob`` asks beside the sampled tokens' log-probs, per prompt, with SGLang 0.5.23's checks
        and words: ``logprob_start_len`` (the prompt's log-probs from that index; -1, the default, none),
        ``top_logprobs_num`` (the top log-probs at each position; 0 or less, none) and ``token_ids_logprob`` (those
        ids' log-probs at each position); each one value, or a list of one per prompt."""
        n = (body.get("sampling_params") or {}).get("n") or 1

        def each(key: str, default: Any, nested: bool = False) -> list[Any]:
            v = body.get(key)
            v = default if v is None or (nested and v == []) else v  # ([] is none, as SGLang reads it)
            if nested and isinstance(v, int):
                v = [v]
            per = isinstance(v, list) and (not nested or (len(prompts) > 1 and bool(v) and isinstance(v[0], list)))
            if nested and not per and v is not None and not all(isinstance(t, int) for t in v):
                raise BadRequest("token_ids_logprob must be a flat list of integers.")
            if per and n > 1:
                raise BadRequest(f"Cannot use list {key} with parallel_sample_num > 1")
            if per and len(v) != len(prompts):
                raise BadRequest(f"{key}: {len(v)} values for {len(prompts)} prompts")
            return list(v) if per else [v] * len(prompts)

        out = []
        vocab = self.s.model.config.get_text_config().vocab_size
        for ids, start, top, wanted in zip(prompts, each("logprob_start_len", -1), each("top_logprobs_num", 0),
                                           each("token_ids_logprob", None, nested=True), strict=True):
            if start < -1:
                raise BadRequest(f"logprob_start_len={start}: -1 (no prompt log-probs) or an index into the prompt")
            if start > len(ids):
                raise BadRequest(f"req.logprob_start_len={start} is higher than the number of input tokens "
                                 f"len(req.origin_input_ids)={len(ids)}. Please use a smaller logprob_start_len.")
            bad = [t for t in wanted or [] if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"token_ids_logprob contains out-of-vocabulary token id {bad[0]}; valid range is "
                                 f"[0, {vocab}).")
            out.append({"logprob_start_len": start, "top_logprobs_num": max(int(top), 0),
                        "token_ids_logprob": list(wanted) if wanted is not None else None})
        return out

    def _check_length(self, ids: list[int], max_new_tokens: int | None) -> None:
        """SGLang's checks before generation (0.5.23): a prompt that fills the context, or a prompt plus
        ``max_new_tokens`` past it, is a 400 with SGLang's messages."""
        n, ctx = len(ids), self.s.max_context
        if n >= ctx:
            raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        if max_new_tokens is not None and n + max_new_tokens > ctx:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
                f"a total of {n + max_new_tokens} tokens: {n} tokens from the input messages and {max_new_tokens} "
                f"tokens for the completion. Please reduce the number of tokens in the input messages or the "
                f"completion to fit within the limit.")

    def _output(self, r: Request, return_logprob: bool, prompt_len: int, index: int | None = None
                ) -> dict[str, Any]:
        """One result as SGLang 0.5.23 writes it: cumulative text and ids; per-token weight versions as
        ``weight_versions`` spans on the finished result only, whose ``weight_version`` is the last span's."""
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": prompt_len,
            "weight_version": self.s.weight_version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,
            # SGLang reports where cached tokens came from when there were any (no host-memory tier here)
            "cached_tokens_details": {"device": r.cached_tokens, "host": 0} if r.cached_tokens else None,
            "dp_rank": None,
        }
        if r.spec_verify_ct:  # as SGLang reports speculative decoding per request
            meta.update({"spec_accept_rate": r.spec_correct / max(r.spec_proposed, 1),
                         "spec_accept_length": len(r.output_ids) / r.spec_verify_ct,
                         "spec_num_correct_drafts": r.spec_correct, "spec_num_proposed_drafts": r.spec_proposed,
                         "spec_verify_ct": r.spec_verify_ct})
        if r.finish_reason is not None:
            meta["response_sent_to_client_ts"] = time.time()
            spans = weight_version_spans(list(r.versions), self.s.weight_version)
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
            meta["e2e_latency"] = time.monotonic() - r.created
        if r.return_routed_experts and r.finish_reason is not None and r.routed:
            rows = torch.cat(r.routed)[r.routed_experts_start_len:]  # [seqlen - 1 - start, layers, top_k]
            meta["routed_experts"] = base64.b64encode(rows.numpy().tobytes()).decode("ascii")
        if return_logprob:
            def triples(pairs: Sequence[tuple[float | None, int]] | None) -> list[list[Any]] | None:
                return None if pairs is None else [[lp, t, None] for lp, t in pairs]

            # (the scheduler's thread may be appending a token: every per-token list as far as all of them go; a
            # request that generates nothing has SGLang's one entry of output top log-probs)
            n = min(len(r.output_ids), len(r.logprobs))
            cut = n if r.params.max_new_tokens > 0 else None
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs[:n], r.output_ids[:n],
                                                                            strict=True)]
            meta["input_token_logprobs"] = triples(r.input_logprobs)
            meta["output_token_logprobs_length"] = n
            if r.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [triples(x) for x in r.input_top]
                meta["output_top_logprobs"] = [triples(x) for x in r.output_top[:cut]]
            if r.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = [triples(x) for x in r.input_ids_logprobs]
                meta["output_token_ids_logprobs"] = [triples(x) for x in r.output_ids_logprobs[:cut]]
        out: dict[str, Any] = {"text": r.text, "output_ids": list(r.output_ids), "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.s.released:
            return error(503, "memory is released; call /resume_memory_occupation first")
        body = await self._json(request)
        params = self._params(body.get("sampling_params"))
        prompts, single = self._prompts(body)
        for ids in prompts:
            self._check_length(ids, params.max_new_tokens)
        rid = body.get("rid")
        return_logprob = bool(body.get("return_logprob", False))
        extras = self._logprob_extras(body, prompts) if return_logprob else [{}] * len(prompts)
        routed, start = bool(body.get("return_routed_experts", False)), body.get("routed_experts_start_len", 0)
        if routed:
            for ids in prompts:  # SGLang's checks (0.5.23)
                if not isinstance(start, int) or start < 0:
                    raise BadRequest(f"recv_req.routed_experts_start_len={start!r} is lower than 0. Please use a "
                                     f"non-negative routed_experts_start_len.")
                if start > len(ids):
                    raise BadRequest(f"recv_req.routed_experts_start_len={start!r} is higher than the number of "
                                     f"input tokens len(req.origin_input_ids)={len(ids)}. Please use a smaller "
                                     f"routed_experts_start_len.")
        loras = self._loras(body.get("lora_path"), len(prompts))
        stream = bool(body.get("stream", False))
        loop = asyncio.get_running_loop()
        reqs: list[tuple[Request, asyncio.Future, int]] = []
        updates: asyncio.Queue = asyncio.Queue()
        for i, ids in enumerate(prompts):
            for _ in range(params.n):
                fut = loop.create_future()
                r = Request(list(ids), params, return_routed_experts=routed and self.s.experts is not None,
                            routed_experts_start_len=start if routed else 0, lora=loras[i], **extras[i])
                # SGLang gives every sample of an n > 1 request a fresh id (so an abort by the request's rid
                # does not reach them), and keeps the caller's rid otherwise.
                if params.n > 1:
                    r.rid = uuid.uuid4().hex
                elif rid is not None:
                    r.rid = rid if single else rid[i] if isinstance(rid, list) else f"{rid}_{i}"
                r.on_done = lambda req, f=fut: loop.call_soon_threadsafe(_resolve, f, req)
                if stream:
                    r.on_token = lambda req: loop.call_soon_threadsafe(updates.put_nowait, req)
                reqs.append((r, fut, len(ids)))
        for r, _, _ in reqs:
            self.s.submit(r)
        if stream:
            indexed = not (single and params.n == 1)
            return await self._stream(request, reqs, updates, return_logprob, indexed)
        try:
            await asyncio.gather(*(f for _, f, _ in reqs))
        except asyncio.CancelledError:  # the client went away: free the engine
            for r, _, _ in reqs:
                r.aborted = "client disconnected"
            raise
        outs = [self._output(r, return_logprob, n) for r, _, n in reqs]
        return web.json_response(outs[0] if single and params.n == 1 else outs)

    def _loras(self, raw: Any, n: int) -> list[str | None]:
        """Each prompt's LoRA adapter from SGLang's ``lora_path`` (a name, or one per prompt), loaded ones only."""
        names = raw if isinstance(raw, list) else [raw] * n
        if len(names) != n or not all(x is None or isinstance(x, str) for x in names):
            raise BadRequest(f"lora_path: an adapter's name, or one (or null) per prompt ({n}): {raw!r}")
        if any(names):
            if self.s.adapters is None:
                raise BadRequest("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
            for name in names:
                if name is not None and name not in self.s.adapters.loaded:
                    raise BadRequest(f"The following requested LoRA adapters are not loaded: {name}\n"
                                     f"Loaded adapters: {list(self.s.adapters.loaded)}.")
        return names

    async def _stream(self, request, reqs, updates: asyncio.Queue, return_logprob: bool, indexed: bool
                      ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Weight-Version": self.s.weight_version})
        await resp.prepare(request)
        pending = {id(r): (r, f, n) for r, f, n in reqs}
        index = {id(r): i for i, (r, _, _) in enumerate(reqs)}
        sent: dict[int, int] = {}  # tokens already streamed per request: a chunk carries something new

        async def send(r: Request, n: int) -> None:
            out = self._output(r, return_logprob, n, index[id(r)] if indexed else None)
            # SGLang stamps a stream's first chunk with the time it went out, and no later one
            if id(r) in sent:
                out["meta_info"].pop("response_sent_to_client_ts", None)
            else:
                out["meta_info"]["response_sent_to_client_ts"] = time.time()
            sent[id(r)] = out["meta_info"]["completion_tokens"]
            await resp.write(f"data: {json.dumps(out)}\n\n".encode())

        try:
            while pending:
                done = [v for v in pending.values() if v[1].done()]
                for r, _, n in done:
                    await send(r, n)
                    del pending[id(r)]
                if not pending:
                    break
                getter = asyncio.ensure_future(updates.get())
                waits = {getter, *(f for _, f, _ in pending.values())}
                finished, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if getter in finished:
                    r = getter.result()
                    if (id(r) in pending and not pending[id(r)][1].done()
                            and len(r.output_ids) > sent.get(id(r), 0)):
                        await send(r, pending[id(r)][2])
                else:
                    getter.cancel()
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            for r, _, _ in reqs:
                r.aborted = "client disconnected"
            raise
        return resp

    # -- status ----------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        r = Request([self.s.tokenizer.eos_token_id or 0], SamplingParams(max_new_tokens=1, temperature=0))
        r.on_done = lambda req: loop.call_soon_threadsafe(_resolve, fut, req)
        self.s.submit(r)
        try:
            async with asyncio.timeout(30):
                await fut
        except TimeoutError:
            return web.Response(status=503, text="generation did not finish in 30s")
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.s.model.config
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.s.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": list(getattr(config, "architectures", None) or []),
        })

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI's model list as SGLang serves it; ``max_model_len`` is the context length."""
        cards = [{"id": self.served_model_name, "object": "model", "created": int(self.started), "owned_by": "sglang",
                  "root": self.model_path, "parent": None, "max_model_len": self.s.max_context}]
        for name, source in (dict(self.s.adapters.loaded) if self.s.adapters is not None else {}).items():
            cards.append({"id": name, "object": "model", "created": int(self.started), "owned_by": "sglang",
                          "root": source, "parent": self.served_model_name, "max_model_len": None})
        return web.json_response({"object": "list", "data": cards})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text, as SGLang serves it with ``--enable-metrics`` (its names where it has them), plus the
        process's CPU seconds (all threads), from which the trainer reports the cores each phase used."""
        lines = []
        for name, kind, value, doc in (
            ("process_cpu_seconds_total", "counter", time.process_time(), "CPU seconds of this engine process"),
            ("sglang:generation_tokens_total", "counter", self.s.generated_tokens, "Tokens generated"),
            ("sglang:prompt_tokens_total", "counter", self.s.prompt_tokens, "Prompt tokens of admitted requests"),
            ("sglang:cached_tokens_total", "counter", self.s.cached_tokens,
             "Prompt tokens not prefilled: prefix cache hits and forked prompts"),
            ("sglang:cache_hit_rate", "gauge", self.s.cached_tokens / max(self.s.prompt_tokens, 1),
             "Cached prompt tokens over prompt tokens"),
            ("sglang:spec_verify_ct_total", "counter", self.s.spec_verify_ct, "Speculative verify steps, by request"),
            ("sglang:spec_proposed_drafts_total", "counter", self.s.spec_proposed, "Draft tokens verified"),
            ("sglang:spec_correct_drafts_total", "counter", self.s.spec_correct, "Draft tokens accepted"),
            ("sglang:num_running_reqs", "gauge", len(self.s.rows), "Requests decoding"),
            ("sglang:num_queue_reqs", "gauge", len(self.s.waiting), "Requests waiting"),
        ):
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def server_info(self, request: web.Request) -> web.Response:
        ctx = self.s.max_context
        return web.json_response({
            **self.server_args,
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "tp_size": 1,
            "dp_size": 1,
            "incremental_streaming_output": False,
            "disaggregation_mode": "null",
            "status": "ready",
            "max_req_input_len": ctx - 1,
            "max_total_num_tokens": ctx * self.s.max_running,
            "version": f"rlx-embedded-{_rlx_version()}",
            "engine": "rlx-embedded",
            "weight_version": self.s.weight_version,
            "internal_states": [{
                "running_requests": len(self.s.rows),
                "waiting_requests": len(self.s.waiting),
                "paused": self.s.paused,
                "decode_steps": self.s.steps,
                "prefill_batches": self.s.prefill_batches,
                "generated_tokens": self.s.generated_tokens,
            }],
        })

    # -- control ---------------------------------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        rid = None if body.get("abort_all") else body.get("rid") or ""
        if rid == "":  # SGLang ignores an abort that names no request
            return web.Response(text="")
        # SGLang matches rids by prefix and answers 200 with an empty body.
        await asyncio.to_thread(self.s.abort, rid, "Aborted")
        return web.Response(text="")

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest("mode must be abort, in_place or retract")

        def pause():
            if mode == "abort":
                self.s._abort(None, "Aborted")
            self.s.paused = True

        await self._call(pause)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._call(lambda: setattr(self.s, "paused", False))
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        def flush():  # as SGLang: only an idle engine flushes
            if not self.s.rows and not self.s.waiting:
                self.s.clear_prefix_cache()

        await self._call(flush)
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def release_memory(self, request: web.Request) -> web.Response:
        def release():
            # SGLang asserts an idle server here (and its scheduler dies otherwise); this engine refuses.
            if self.s.rows or self.s.waiting:
                raise BadRequest("release_memory_occupation needs an idle server (pause generation first)")
            self.s.clear_prefix_cache()  # as SGLang's KV cache, it goes with the memory
            if self.s.device.type == "cuda":
                import torch

                from rlx.rollout.engines.embedded.weights import move_held

                for m in (self.s.model, self.s.draft):
                    if m is not None:
                        m.to("cpu")
                move_held(self.s.model, "cpu")
                if self.s.mtp is not None:  # its layer's tensors are the held ones
                    self.s.mtp.bind()
                torch.cuda.empty_cache()
            self.s.released = True

        await self._call(release)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        def resume():
            if not self.s.released:
                raise BadRequest("resume_memory_occupation: nothing was released")
            from rlx.rollout.engines.embedded.weights import move_held

            for m in (self.s.model, self.s.draft):
                if m is not None:
                    m.to(self.s.device)
            move_held(self.s.model, self.s.device)
            if self.s.mtp is not None:  # its layer's tensors are the held ones, which moved
                self.s.mtp.bind()
            self.s.released = False

        await self._call(resume)
        return web.json_response(None)


def _rlx_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlx")
    except PackageNotFoundError:
        return "dev"


def _resolve(fut: asyncio.Future[Request], value: Request) -> None:
    if not fut.done():
        fut.set_result(value)
