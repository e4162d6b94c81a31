"""The embedded engine's HTTP server: SGLang's native API over a `Scheduler`, on 127.0.0.1.

Routes, request fields and response shapes follow SGLang's ``http_server.py`` so that the client,
router and everything above them run unchanged against either engine. Every response carries the
engine's weight version: in the JSON body where the body is an object (``weight_version``, and
``meta_info.weight_version`` for generations) and in the ``X-Weight-Version`` header everywhere.
Errors are ``{"error": {"message": ...}}`` with a 4xx for bad requests, as SGLang sends them.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from rlx.rollout.engines.embedded import weights as W
from rlx.rollout.engines.embedded.scheduler import Request, SamplingParams, Scheduler

_SAMPLING_KEYS = set(SamplingParams.__dataclass_fields__)
# Accepted for compatibility with SGLang clients; they do not change what this engine does.
_IGNORED_SAMPLING_KEYS = {"frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
                          "spaces_between_special_tokens", "sampling_seed", "json_schema", "regex",
                          "ebnf", "custom_params", "logit_bias"}


class BadRequest(Exception):
    pass


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class EngineServer:
    def __init__(self, scheduler: Scheduler, *, model_path: str, served_model_name: str | None = None,
                 server_args: dict[str, Any] | None = None):
        self.s = scheduler
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.server_args = server_args or {}
        self.groups: dict[str, W.BroadcastGroup] = {}  # weight-update groups by name (one per sending rank)
        self.app = web.Application(middlewares=[self._middleware], client_max_size=1 << 31)
        r = self.app.router
        r.add_post("/generate", self.generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health if path == "/health" else self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/weights_checksum", self.weights_checksum)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/release_memory_occupation", self.release_memory)
        r.add_post("/resume_memory_occupation", self.resume_memory)

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        try:
            resp = await handler(request)
        except BadRequest as e:
            resp = _error(400, str(e))
        except W.WireError as e:
            resp = web.json_response({"success": False, "message": str(e)}, status=400)
        except json.JSONDecodeError as e:
            resp = _error(400, f"body is not valid JSON: {e}")
        except web.HTTPException:
            raise
        except (TypeError, ValueError, KeyError) as e:
            resp = _error(400, f"{type(e).__name__}: {e}")
        except Exception as e:
            resp = _error(500, f"{type(e).__name__}: {e}")
        resp.headers["X-Weight-Version"] = self.s.weight_version
        return resp

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        body = await request.json()
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    async def _call(self, fn):
        return await asyncio.to_thread(self.s.call, fn)

    def _ok(self, **extra: Any) -> web.Response:
        return web.json_response({"success": True, "message": "ok", "weight_version": self.s.weight_version,
                                  **extra})

    # -- generation ------------------------------------------------------------------------------

    def _params(self, raw: Any) -> SamplingParams:
        raw = raw or {}
        if not isinstance(raw, dict):
            raise BadRequest("sampling_params must be an object")
        unknown = set(raw) - _SAMPLING_KEYS - _IGNORED_SAMPLING_KEYS
        if unknown:
            raise BadRequest(f"unknown sampling_params: {', '.join(sorted(unknown))}")
        p = SamplingParams(**{k: v for k, v in raw.items() if k in _SAMPLING_KEYS and v is not None})
        if isinstance(p.stop, str):
            p.stop = [p.stop]
        if p.temperature < 0 or not 0 < p.top_p <= 1 or not 0 <= p.min_p <= 1 or p.n < 1:
            raise BadRequest("need temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1 and n >= 1")
        if p.max_new_tokens is None or p.max_new_tokens < 0:
            raise BadRequest("max_new_tokens must be >= 0")
        return p

    def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            single = bool(ids) and isinstance(ids[0], int)
            batch = [ids] if single else ids
        elif body.get("text") is not None:
            text = body["text"]
            single = isinstance(text, str)
            batch = [self.s.tokenizer.encode(t, add_special_tokens=False) for t in ([text] if single else text)]
        else:
            raise BadRequest("either text or input_ids must be given")
        vocab = self.s.model.config.vocab_size
        for ids in batch:
            if not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise BadRequest(f"input_ids must be non-empty lists of ints in [0, {vocab})")
        return batch, single

    def _output(self, r: Request, return_logprob: bool, prompt_len: int) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(r.output_ids),
            "cached_tokens": 0,
            "weight_version": self.s.weight_version,
            "output_token_weight_versions": list(r.versions),
            "e2e_latency": time.monotonic() - r.created,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.output_ids, strict=True)]
            meta["input_token_logprobs"] = []
        return {"text": r.text, "output_ids": list(r.output_ids), "meta_info": meta}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.s.released:
            return _error(503, "memory is released; call /resume_memory_occupation first")
        body = await self._json(request)
        params = self._params(body.get("sampling_params"))
        prompts, single = self._prompts(body)
        rid = body.get("rid")
        return_logprob = bool(body.get("return_logprob", False))
        stream = bool(body.get("stream", False))
        loop = asyncio.get_running_loop()
        reqs: list[tuple[Request, asyncio.Future, int]] = []
        updates: asyncio.Queue = asyncio.Queue()
        for i, ids in enumerate(prompts):
            for j in range(params.n):
                fut = loop.create_future()
                r = Request(list(ids), params)
                if rid is not None:
                    r.rid = rid if (len(prompts) * params.n == 1) else f"{rid}-{i}-{j}" if isinstance(rid, str) else rid[i]
                r.on_done = lambda req, f=fut: loop.call_soon_threadsafe(_resolve, f, req)
                if stream:
                    r.on_token = lambda req: loop.call_soon_threadsafe(updates.put_nowait, req)
                reqs.append((r, fut, len(ids)))
        for r, _, _ in reqs:
            self.s.submit(r)
        if stream:
            return await self._stream(request, reqs, updates, return_logprob)
        try:
            await asyncio.gather(*(f for _, f, _ in reqs))
        except asyncio.CancelledError:  # the client went away: free the engine
            for r, _, _ in reqs:
                r.aborted = "client disconnected"
            raise
        outs = [self._output(r, return_logprob, n) for r, _, n in reqs]
        return web.json_response(outs[0] if single and params.n == 1 else outs)

    async def _stream(self, request, reqs, updates: asyncio.Queue, return_logprob: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Weight-Version": self.s.weight_version})
        await resp.prepare(request)
        pending = {id(r): (r, f, n) for r, f, n in reqs}

        async def send(r: Request, n: int) -> None:
            await resp.write(f"data: {json.dumps(self._output(r, return_logprob, n))}\n\n".encode())

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
                    if id(r) in pending and not pending[id(r)][1].done():
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
            await asyncio.wait_for(fut, 30)
        except TimeoutError:
            return web.Response(status=503, text="generation did not finish in 30s")
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "weight_version": self.s.weight_version,
            "model_type": getattr(self.s.model.config, "model_type", None),
        })

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            **self.server_args,
            "model_path": self.model_path,
            "version": "rlx-embedded",
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

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.s.weight_version})

    # -- control ---------------------------------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        rid = None if body.get("abort_all") else body.get("rid")
        if rid is None and not body.get("abort_all"):
            raise BadRequest("give rid, or abort_all: true")
        n = await asyncio.to_thread(self.s.abort, rid, "aborted by request")
        return self._ok(aborted=n)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest("mode must be abort, in_place or retract")

        def pause():
            if mode == "abort":
                self.s._abort(None, "paused")
            self.s.paused = True

        await self._call(pause)
        return self._ok()

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._call(lambda: setattr(self.s, "paused", False))
        return self._ok()

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def release_memory(self, request: web.Request) -> web.Response:
        def release():
            if self.s.rows or self.s.waiting:
                raise BadRequest("cannot release memory while requests are running")
            if self.s.device.type == "cuda":
                import torch

                self.s.model.to("cpu")
                torch.cuda.empty_cache()
            self.s.released = True

        await self._call(release)
        return self._ok()

    async def resume_memory(self, request: web.Request) -> web.Response:
        def resume():
            self.s.model.to(self.s.device)
            self.s.released = False

        await self._call(resume)
        return self._ok()

    # -- weights ---------------------------------------------------------------------------------

    def _set_version(self, body: dict[str, Any]) -> None:
        v = body.get("weight_version")
        if v is not None:
            self.s.weight_version = str(v)

    async def _update(self, body: dict[str, Any], load) -> web.Response:
        def apply():
            if body.get("abort_all_requests"):
                self.s._abort(None, "aborted for a weight update")
            n = load()
            self._set_version(body)
            return n

        n = await self._call(apply)
        return self._ok(num_tensors=n, num_paused_requests=0)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        path = body.get("model_path")
        if not path:
            raise BadRequest("model_path is required")
        return await self._update(body, lambda: W.load_from_disk(self.s.model, path))

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads:
            raise BadRequest("serialized_named_tensors must be a non-empty list")
        # A payload per tensor-parallel rank; this engine has one rank.
        named = await asyncio.to_thread(W.deserialize_named_tensors, payloads[0])
        return await self._update(body, lambda: W.load_named(self.s.model, named))

    async def init_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        try:
            args = dict(master_address=body["master_address"], master_port=int(body["master_port"]),
                        rank=int(body["rank_offset"]), world_size=int(body["world_size"]),
                        group_name=body.get("group_name", "weight_update_group"),
                        backend=body.get("backend", "gloo"), local_address=self.server_args.get("host"))
        except (KeyError, ValueError) as e:
            raise BadRequest(f"init_weights_update_group needs master_address, master_port, rank_offset, "
                             f"world_size: {e}") from None
        try:
            self.groups[args["group_name"]] = await asyncio.to_thread(W.BroadcastGroup, **args)
        except Exception as e:
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"}, status=500)
        return self._ok()

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        self.groups.pop(body.get("group_name", "weight_update_group"), None)
        return self._ok()

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if body.get("new_version") is None:
            raise BadRequest("new_version is required")

        def apply():
            if body.get("abort_all_requests"):
                self.s._abort(None, "aborted for a weight update")
            self.s.weight_version = str(body["new_version"])

        await self._call(apply)
        return self._ok()

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        name = body.get("group_name", "weight_update_group")
        group = self.groups.get(name)
        if group is None:
            raise BadRequest(f"no weight update group {name!r}; call /init_weights_update_group first")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise BadRequest("names, dtypes and shapes are required lists")
        # Receive outside the scheduler thread (generation goes on), then swap in between two steps.
        named = await asyncio.to_thread(group.receive, names, dtypes, shapes)
        return await self._update(body, lambda: W.load_named(self.s.model, named))

    async def weights_checksum(self, request: web.Request) -> web.Response:
        """rlx's own route (SGLang has none): per-tensor hashes of the served weights, for full verification."""
        body = await self._json(request)
        names = body.get("names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise BadRequest("names: a list of weight names, or null for all")
        return web.json_response(await self._call(lambda: W.checksums(self.s.model, names)))

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await self._json(request) if request.method == "POST" else dict(request.query)
        if "name" not in body:
            raise BadRequest("name is required")
        values = await self._call(lambda: W.weights_by_name(self.s.model, body["name"],
                                                             int(body.get("truncate_size", 100))))
        return web.json_response(values)


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)
