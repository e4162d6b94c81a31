"""The adapter server: OpenAI- and Anthropic-compatible endpoints in front of rlx's engines.

An unmodified harness (an agent SDK, a coding CLI, a user's loop) talks to it as to a hosted API; each
request is served by the engines through the same `GenerateContext` as any generator, and recorded
token-in-token-out in a `Session` (`rlx.agent.tito`), which becomes training samples.

* Endpoints: ``POST /v1/chat/completions``, ``/v1/responses``, ``/v1/messages``,
  ``/v1/messages/count_tokens``; ``GET /v1/models``, ``/health``. rlx's own: ``POST /rlx/sessions``
  (a new session and its key), ``GET /rlx/sessions/{id}`` (its turns and mismatch counts).
* Auth: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``; KEY is the server's key or a session's.
  A missing or wrong key gets 401 in the API's own error shape.
* The session of a request: the session key it was made with, else an ``x-rlx-session`` header, else
  request metadata (``metadata.session_id``, OpenAI ``user``, Anthropic ``metadata.user_id``), else a
  throwaway one.
* Streaming: the reply is generated whole, then sent as the SSE events each SDK parses (the point is
  compatibility with harnesses, not time to first token).
* Overhead (time in the handler minus time in the engine) is kept per request for the benchmark.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections import OrderedDict, deque
from typing import Any

from aiohttp import web

from rlx.agent import formats
from rlx.agent.parsers import parser_for
from rlx.agent.tito import Renderer, Session
from rlx.http import bearer_key, serve_local
from rlx.protocols import Generation
from rlx.rollout.engines.client import EngineError, GenerateResult


class AgentAdapter:
    def __init__(self, ctx: Generation, *, model_name: str = "rlx", api_key: str | None = None,
                 parser: str = "auto", model_type: str | None = None, compare: bool = True,
                 max_history: int = 10_000, max_hinted_sessions: int = 10_000, max_output_tokens: int | None = None):
        """`max_history` stored Responses conversations and `max_hinted_sessions` sessions named by a
        header or metadata are kept, the oldest dropped first (a long-running `rl serve` does not grow).
        `max_output_tokens`: the most one call generates, as a model's maximum output (training sets it to
        ``rollout.sampling.max_new_tokens``); a caller's larger or unset ``max_tokens`` gets this many, and a
        reply cut there is answered as a finished turn (the sample records the cut). None: the caller's
        ``max_tokens``, and unset means up to the context, as the APIs do."""
        self.ctx = ctx
        self.model_name = model_name
        self.api_key = api_key or f"rlx-{secrets.token_hex(16)}"
        self.parse = parser_for(parser, model_type)
        self.renderer = Renderer(ctx.tokenizer)
        self.eos_id = getattr(ctx.tokenizer, "eos_token_id", None)
        self.compare = compare
        self.sessions: dict[str, Session] = {}
        self.keys: dict[str, str] = {}  # session key -> session id
        # Responses API: response id -> conversation after it, for previous_response_id (the newest kept)
        self.history: OrderedDict[str, list[dict]] = OrderedDict()
        self.max_history = max_history
        self.max_hinted_sessions = max_hinted_sessions
        self.max_output_tokens = max_output_tokens
        self._hinted: OrderedDict[str, None] = OrderedDict()  # sessions made from headers/metadata, oldest first
        self.overheads: deque[float] = deque(maxlen=100_000)  # seconds per request, engine time excluded
        self.runner: web.AppRunner | None = None
        self.base_url = ""

    # -- sessions --------------------------------------------------------------------------------

    def open_session(self, session_id: str | None = None, ctx: Generation | None = None,
                     max_output_tokens: int | None = None) -> tuple[Session, str]:
        """A new session and the API key that routes requests to it. `ctx` and `max_output_tokens`: the
        generation context and maximum output of this session's calls (default: the adapter's), e.g. an
        evaluation dataset's sampling."""
        sid = session_id or uuid.uuid4().hex
        session = self.sessions[sid] = Session(sid, self.renderer, self.compare)
        session.ctx, session.max_output_tokens = ctx, max_output_tokens
        key = f"rlx-s-{secrets.token_hex(16)}"
        self.keys[key] = sid
        return session, key

    def close_session(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        for k in [k for k, v in self.keys.items() if v == session.id]:
            del self.keys[k]

    # -- server ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        for path, api in (("/v1/chat/completions", "chat"), ("/v1/responses", "responses"),
                          ("/v1/messages", "messages")):
            app.router.add_post(path, self._route(api))
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_route("HEAD", "/", self.health)  # Claude Code's first request: is anything there
        app.router.add_post("/rlx/sessions", self.new_session)
        app.router.add_get("/rlx/sessions/{sid}", self.get_session)
        return app

    def _route(self, api: str):
        async def route(request: web.Request) -> web.StreamResponse:
            return await self.handle(request, api)

        return route

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.runner, self.base_url = await serve_local(self.app(), host, port)
        return self.base_url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # -- requests --------------------------------------------------------------------------------

    def _auth(self, request: web.Request) -> Session | None:
        key = bearer_key(request) or request.headers.get("x-api-key", "")
        if key and key in self.keys:
            return self.sessions.get(self.keys[key])
        if key and secrets.compare_digest(key, self.api_key):
            return None
        raise formats.WireError(401, "missing or invalid API key" if key else "no API key: send Authorization: Bearer "
                             "KEY or x-api-key: KEY", "authentication_error")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            raise formats.WireError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise formats.WireError(400, "the request body must be a JSON object")
        return body

    def _session(self, request: web.Request, req: formats.Request) -> Session:
        hint = request.headers.get("x-rlx-session") or req.session_hint
        if hint is None:
            return Session("ephemeral", self.renderer, compare=False)
        if hint not in self.sessions:
            self.sessions[hint] = Session(hint, self.renderer, self.compare)
            self._hinted[hint] = None
            while len(self._hinted) > self.max_hinted_sessions:
                self.sessions.pop(self._hinted.popitem(last=False)[0], None)
        return self.sessions[hint]

    async def handle(self, request: web.Request, api: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            session = self._auth(request)
            body = await self._body(request)
            if api == "chat":
                req = formats.parse_chat(body)
            elif api == "responses":
                req = formats.parse_responses(body, self.history)
            else:
                req = formats.parse_messages(body)
            session = session or self._session(request, req)
            ctx = session.ctx or self.ctx
            chain, ids, turn = session.prepare(req.messages, req.tools)
            overrides: dict[str, Any] = {"stop": list(ctx.sampling.stop) + req.stop}
            context = ctx.context_length
            room = None if context is None else context - len(ids) - 1  # what the engine takes (GenerateContext)
            # the chain ends here, truncated (as a sample that grew to the limit)
            if context is not None and room is not None and room < 1:
                session.record(chain, turn, GenerateResult(
                    text="", output_ids=[], output_logprobs=[], finish_reason="length", matched_stop=None,
                    weight_version="", token_weight_versions=[], prompt_tokens=len(ids), rid=None, raw={}),
                    {"role": "assistant", "content": ""}, self.eos_id)
                raise formats.too_long(api, len(ids), context)
            # more than fits is cut to fit (by GenerateContext.generate); unset: up to the context, as the APIs do
            want = req.max_tokens if req.max_tokens is not None else room
            cap = session.max_output_tokens or self.max_output_tokens
            capped = cap is not None and (want is None or want > cap)
            if capped:
                want = cap
            if want is not None:
                overrides["max_new_tokens"] = want
            if req.temperature is not None:
                overrides["temperature"] = float(req.temperature)
            if req.top_p is not None:
                overrides["top_p"] = float(req.top_p)
            t_engine = time.perf_counter()
            rid = f"{session.id}-{uuid.uuid4().hex[:8]}"
            res = await ctx.generate(ids, ctx.sampling_params(**overrides), rid)
            engine_s = time.perf_counter() - t_engine
            text = ctx.tokenizer.decode(res.output_ids, skip_special_tokens=True)
            matched = res.matched_stop if isinstance(res.matched_stop, str) else None
            if res.finish_reason == "stop" and matched and matched in text:
                text = text[:text.find(matched)]
            finish = res.finish_reason
            if capped and cap is not None and finish == "length" and len(res.output_ids) >= cap:
                # Cut by the policy's maximum output, not by what the caller asked: answered as a finished turn,
                # so that the harness goes on (harnesses treat max_tokens as an error or ask to continue, which
                # the budget forbids). The sample still records the cut (finish "length").
                finish = "stop"
            reply = formats.Reply(self.parse(text), finish, matched, len(ids), len(res.output_ids),
                               cached_tokens=res.cached_tokens)
            session.record(chain, turn, res, reply.message(), self.eos_id)
            if api == "responses":
                self.history[f"resp_{reply.id}"] = req.messages + [reply.message()]
                while len(self.history) > self.max_history:
                    self.history.popitem(last=False)
            if req.stream:
                out = await self._stream(request, api, req, reply)
            elif api == "chat":
                out = web.json_response(formats.chat_response(req, reply))
            elif api == "responses":
                out = web.json_response(formats.responses_response(req, reply))
            else:
                out = web.json_response(formats.messages_response(req, reply))
            self.overheads.append(time.perf_counter() - t0 - engine_s)
            return out
        except formats.WireError as e:
            return web.json_response(formats.error_body(api, e), status=e.status)
        except EngineError as e:
            if e.status in (400, 413):  # the engine refused the request itself (SGLang's checks, e.g. a prompt past
                #                         its context): the caller's error, not worth a retry
                error = formats.WireError(400, f"the engine refused the request: {e}")
            else:
                error = formats.WireError(503, f"engine error: {e}", "api_error")
            return web.json_response(formats.error_body(api, error), status=error.status)

    async def _stream(self, request: web.Request, api: str, req: formats.Request, reply: formats.Reply) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        events = {"chat": formats.chat_stream, "responses": formats.responses_stream, "messages": formats.messages_stream}[api]
        for chunk in events(req, reply):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            self._auth(request)
            req = formats.parse_messages(await self._body(request), count_only=True)
            n = len(self.renderer.prompt(req.messages, req.tools))
            return web.json_response({"input_tokens": n})
        except formats.WireError as e:
            return web.json_response(formats.error_body("messages", e), status=e.status)

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._auth(request)
        except formats.WireError as e:
            return web.json_response(formats.error_body("chat", e), status=e.status)
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlx",
             "type": "model", "display_name": self.model_name, "created_at": "1970-01-01T00:00:00Z"}]})

    def _admin(self, request: web.Request) -> None:
        """Session management takes the adapter's own key: a session's key (which a harness, and the code it
        runs, holds) only talks to the model."""
        if self._auth(request) is not None:
            raise formats.WireError(403, "a session's key cannot manage sessions: use the adapter's API key",
                                 "permission_error")

    async def new_session(self, request: web.Request) -> web.Response:
        try:
            self._admin(request)
        except formats.WireError as e:
            return web.json_response(formats.error_body("chat", e), status=e.status)
        session, key = self.open_session()
        return web.json_response({"session_id": session.id, "api_key": key})

    async def get_session(self, request: web.Request) -> web.Response:
        try:
            self._admin(request)
        except formats.WireError as e:
            return web.json_response(formats.error_body("chat", e), status=e.status)
        s = self.sessions.get(request.match_info["sid"])
        if s is None:
            return web.json_response(formats.error_body("chat", formats.WireError(404, "no such session")), status=404)
        return web.json_response({
            "session_id": s.id, "chains": len(s.chains), "mismatches": s.mismatch_counts(),
            "turns": [{"kind": t.kind, "chain": t.chain, "new_tokens": t.new_tokens, "sampled": t.sampled,
                       "mismatches": t.mismatches} for t in s.turns],
            "samples": [json.loads(json.dumps(x.to_dict())) for x in s.samples()]})


async def serve_forever(adapter: AgentAdapter, host: str, port: int, on_ready=None) -> None:
    """Run the adapter until cancelled (Ctrl-C in `rl serve`)."""
    url = await adapter.start(host, port)
    if on_ready is not None:
        on_ready(url)
    try:
        await asyncio.Event().wait()
    finally:
        await adapter.stop()
