"""The three wire formats, to and from one internal form.

Requests become a `Request`: HF-style chat messages (``role``, ``content``, ``tool_calls`` with
``function.name``/``arguments``, ``tool`` turns with ``tool_call_id``), tools in the OpenAI function
form that chat templates take, and sampling settings. Replies are built from a `Reply` (the parsed
assistant turn) in each API's own shape, whole or as the SSE events its official SDK parses.
Malformed input raises `WireError` with the status and the API-specific error type.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlx.agent.parsers import Parsed

if TYPE_CHECKING:
    from rlx.types import JSON


class WireError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def too_long(api: str, tokens: int, context: int) -> WireError:
    """A prompt that leaves no room in the context, in the words each API uses: what makes a harness compact its
    conversation (and the compacted one becomes a new chain, a sample of its own)."""
    if api == "messages":  # the largest prompt that leaves room for one token is context - 2 (GenerateContext)
        return WireError(400, f"prompt is too long: {tokens} tokens > {context - 2} maximum")
    return WireError(400, f"This model's maximum context length is {context} tokens. However, your messages "
                          f"resulted in {tokens} tokens, which leaves no room for a completion. Please reduce the "
                          f"length of the messages.",
                     param="messages" if api == "chat" else "input", code="context_length_exceeded")


@dataclass
class Request:
    api: str  # "chat" | "responses" | "messages"
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: list[str]
    stream: bool
    session_hint: str | None = None  # from request metadata
    include_usage: bool = False
    previous_response_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # Responses: flat tool name -> (namespace,
    #                                                                      name), for tools offered inside namespaces


@dataclass
class Reply:
    parsed: Parsed
    finish: str  # the engine's: "stop", "length", "abort"
    matched_stop: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those the engine took from its prefix cache
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def message(self) -> dict[str, Any]:
        """The assistant turn as a chat message (what the harness will send back next turn)."""
        m: dict[str, Any] = {"role": "assistant", "content": self.parsed.text}
        if self.parsed.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in self.parsed.tool_calls]
        return m


# -- helpers -------------------------------------------------------------------------------------


def _need(body: dict, key: str, kind: type | tuple, where: str = "") -> Any:
    if key not in body:
        raise WireError(400, f"{where}{key}: field required", param=key)
    value = body[key]
    if not isinstance(value, kind):
        raise WireError(400, f"{where}{key}: expected {_tname(kind)}, got {type(value).__name__}", param=key)
    return value


def _opt(body: dict, key: str, kind: type | tuple, default: JSON = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise WireError(400, f"{key}: expected {_tname(kind)}, got bool", param=key)
    if not isinstance(value, kind):
        raise WireError(400, f"{key}: expected {_tname(kind)}, got {type(value).__name__}", param=key)
    return value


def _tname(kind: type | tuple) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def _text_of(content: JSON, where: str, ok=("text", "input_text", "output_text")) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ok:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise WireError(400, f"{where}.content[{i}]: unsupported content part {kind!r} (text only)")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise WireError(400, f"{where}.content: expected a string or a list of parts")


def _stops(value: JSON) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise WireError(400, "stop: expected a string or a list of strings", param="stop")


def _sampling(body: dict, max_keys: tuple[str, ...]) -> dict[str, Any]:
    max_tokens = None
    for k in max_keys:
        if body.get(k) is not None:
            max_tokens = _opt(body, k, int)
            if max_tokens < 1:
                raise WireError(400, f"{k}: must be at least 1", param=k)
    temperature = _opt(body, "temperature", (int, float))
    if temperature is not None and not 0 <= temperature <= 2:
        raise WireError(400, "temperature: must be between 0 and 2", param="temperature")
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": _opt(body, "top_p", (int, float))}


def _metadata_session(body: dict, *keys: str) -> str | None:
    meta = body.get("metadata")
    if isinstance(meta, dict):
        for k in keys:
            if isinstance(meta.get(k), str):
                return meta[k]
    return None


def _sse(event: str | None, data: JSON) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def _pieces(text: str, size: int = 16) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or []


# -- OpenAI Chat Completions ---------------------------------------------------------------------


def parse_chat(body: dict) -> Request:
    model = _need(body, "model", str)
    raw = _need(body, "messages", list)
    if not raw:
        raise WireError(400, "messages: must not be empty", param="messages")
    if _opt(body, "n", int, 1) != 1:
        raise WireError(400, "n: only n=1 is supported (one trajectory per session)", param="n")
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise WireError(400, f"{where}: expected an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise WireError(400, f"{where}.role: must be system, developer, user, assistant or tool, not {role!r}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _text_of(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise WireError(400, f"{where}.tool_calls[{j}].function.name: field required")
                calls.append({"id": c.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": fn.get("arguments") or "{}"}})
            msg["tool_calls"] = calls
        if role == "tool":
            msg["tool_call_id"] = _need(m, "tool_call_id", str, f"{where}.")
        messages.append(msg)
    tools: list[dict[str, Any]] | None = None
    if body.get("tools") is not None:
        tools = []
        for i, t in enumerate(_need(body, "tools", list)):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise WireError(400, f"tools[{i}].function.name: field required", param="tools")
            tools.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                           if k in fn}})
        if body.get("tool_choice") == "none":
            tools = None
    opts = body.get("stream_options") or {}
    return Request("chat", model, messages, tools or None, stop=_stops(body.get("stop")),
                   stream=bool(_opt(body, "stream", bool, False)),
                   session_hint=_metadata_session(body, "session_id") or (body.get("user") or None),
                   include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
                   **_sampling(body, ("max_completion_tokens", "max_tokens")))


def _chat_finish(r: Reply) -> str:
    if r.parsed.tool_calls:
        return "tool_calls"
    return "length" if r.finish == "length" else "stop"


def chat_response(req: Request, r: Reply) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": r.parsed.text or None}
    if r.parsed.reasoning is not None:
        msg["reasoning_content"] = r.parsed.reasoning
    if r.parsed.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in r.parsed.tool_calls]
    return {"id": f"chatcmpl-{r.id}", "object": "chat.completion", "created": r.created, "model": req.model,
            "choices": [{"index": 0, "message": msg, "finish_reason": _chat_finish(r), "logprobs": None}],
            "usage": _chat_usage(r)}


def _chat_usage(r: Reply) -> dict[str, Any]:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


def chat_stream(req: Request, r: Reply) -> Iterator[bytes]:
    base = {"id": f"chatcmpl-{r.id}", "object": "chat.completion.chunk", "created": r.created, "model": req.model}

    def chunk(delta: dict, finish: str | None = None) -> bytes:
        return _sse(None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                "logprobs": None}]})

    yield chunk({"role": "assistant", "content": ""})
    if r.parsed.reasoning is not None:
        for piece in _pieces(r.parsed.reasoning):
            yield chunk({"reasoning_content": piece})
    for piece in _pieces(r.parsed.text):
        yield chunk({"content": piece})
    for i, c in enumerate(r.parsed.tool_calls):
        yield chunk({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": ""}}]})
        for piece in _pieces(c.arguments):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    yield chunk({}, _chat_finish(r))
    if req.include_usage:
        yield _sse(None, {**base, "choices": [], "usage": _chat_usage(r)})
    yield b"data: [DONE]\n\n"


# -- OpenAI Responses ----------------------------------------------------------------------------


def parse_responses(body: dict, history: dict[str, list[dict]]) -> Request:
    model = _need(body, "model", str)
    inp = body.get("input")
    messages: list[dict[str, Any]] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        if prev not in history:
            raise WireError(404, f"previous_response_id: no response {prev!r} on this server", "not_found_error",
                            "previous_response_id")
        messages = [dict(m) for m in history[prev]]
    if isinstance(body.get("instructions"), str):
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise WireError(400, f"{where}: expected an object", param="input")
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("system", "developer", "user", "assistant"):
                    raise WireError(400, f"{where}.role: must be system, developer, user or assistant", param="input")
                messages.append({"role": "system" if role == "developer" else role,
                                 "content": _text_of(item.get("content"), where)})
            elif kind == "function_call":
                name = _need(item, "name", str, f"{where}.")
                if isinstance(item.get("namespace"), str):
                    name = f"{item['namespace']}.{name}"
                call = {"id": _need(item, "call_id", str, f"{where}."), "type": "function",
                        "function": {"name": name,
                                     "arguments": item.get("arguments") or "{}"}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                out = item.get("output")
                messages.append({"role": "tool", "tool_call_id": _need(item, "call_id", str, f"{where}."),
                                 "content": out if isinstance(out, str) else json.dumps(out)})
            elif kind == "reasoning":
                continue
            else:
                raise WireError(400, f"{where}.type: unsupported input item {kind!r}", param="input")
    elif prev is None:
        raise WireError(400, "input: field required", param="input")
    if not any(m["role"] != "system" for m in messages):
        raise WireError(400, "input: no messages to respond to", param="input")
    tools, namespaced = _responses_tools(body)
    return Request("responses", model, messages, tools, stop=[], stream=bool(_opt(body, "stream", bool, False)),
                   session_hint=_metadata_session(body, "session_id"), previous_response_id=prev,
                   namespaced=namespaced, **_sampling(body, ("max_output_tokens",)))


def _responses_tools(body: dict) -> tuple[list[dict[str, Any]] | None, dict[str, tuple[str, str]]]:
    """The function tools the model is offered, and the namespaced ones' flat names.

    Function tools go as they are; a ``namespace`` tool (function tools grouped under a name, as Codex sends them)
    offers each of its functions as ``<namespace>.<name>``, and the model's call comes back with ``name`` and
    ``namespace`` apart. Tools that are not functions (``web_search``, ``file_search``, ``custom``, ...) are
    hosted by the API or need a grammar: the model is not offered them, and the request is served without them.
    """
    if not body.get("tools"):
        return None, {}
    tools: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}

    def function(t: dict, where: str, prefix: str = "") -> dict[str, Any]:
        if not isinstance(t.get("name"), str):
            raise WireError(400, f"{where}.name: field required", param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        fn["name"] = prefix + t["name"]
        return {"type": "function", "function": fn}

    for i, t in enumerate(_need(body, "tools", list)):
        if not isinstance(t, dict):
            raise WireError(400, f"tools[{i}]: expected an object", param="tools")
        if t.get("type") == "function":
            tools.append(function(t, f"tools[{i}]"))
        elif t.get("type") == "namespace":
            ns = t.get("name")
            if not isinstance(ns, str):
                raise WireError(400, f"tools[{i}].name: field required", param="tools")
            for j, sub in enumerate(t.get("tools") or []):
                if isinstance(sub, dict) and sub.get("type", "function") == "function":
                    tools.append(function(sub, f"tools[{i}].tools[{j}]", f"{ns}."))
                    namespaced[tools[-1]["function"]["name"]] = (ns, sub["name"])
    return tools or None, namespaced


def _responses_items(req: Request, r: Reply) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if r.parsed.reasoning is not None:
        items.append({"type": "reasoning", "id": f"rs_{r.id}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": r.parsed.reasoning}]})
    if r.parsed.text or not r.parsed.tool_calls:
        items.append({"type": "message", "id": f"msg_{r.id}", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": r.parsed.text, "annotations": []}]})
    for c in r.parsed.tool_calls:
        call = {"type": "function_call", "id": f"fc_{c.id}", "call_id": c.id, "name": c.name,
                "arguments": c.arguments, "status": "completed"}
        if c.name in req.namespaced:
            call["namespace"], call["name"] = req.namespaced[c.name]
        items.append(call)
    return items


def responses_response(req: Request, r: Reply, status: str | None = None) -> dict[str, Any]:
    incomplete = r.finish == "length"
    status = status or ("incomplete" if incomplete else "completed")
    return {
        "id": f"resp_{r.id}", "object": "response", "created_at": r.created, "status": status,
        "model": req.model, "output": _responses_items(req, r) if status != "in_progress" else [],
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": None, "max_output_tokens": req.max_tokens, "parallel_tool_calls": True,
        "previous_response_id": req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": "auto", "tools": [{"type": "function", **t["function"]} for t in req.tools or []],
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
        "usage": {"input_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens,
                  "total_tokens": r.prompt_tokens + r.completion_tokens,
                  "input_tokens_details": {"cached_tokens": r.cached_tokens}, "output_tokens_details": {"reasoning_tokens": 0}},
    }


def responses_stream(req: Request, r: Reply) -> Iterator[bytes]:
    seq = iter(range(1_000_000))

    def ev(kind: str, **data: Any) -> bytes:
        return _sse(kind, {"type": kind, "sequence_number": next(seq), **data})

    yield ev("response.created", response=responses_response(req, r, "in_progress"))
    yield ev("response.in_progress", response=responses_response(req, r, "in_progress"))
    for idx, item in enumerate(_responses_items(req, r)):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield ev("response.output_item.added", output_index=idx,
                     item={**item, "status": "in_progress", "content": []})
            part = {"type": "output_text", "text": "", "annotations": []}
            yield ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0, part=part)
            for piece in _pieces(text):
                yield ev("response.output_text.delta", item_id=item["id"], output_index=idx, content_index=0,
                         delta=piece, logprobs=[])
            yield ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text,
                     logprobs=[])
            yield ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                     part={**part, "text": text})
        elif item["type"] == "function_call":
            yield ev("response.output_item.added", output_index=idx,
                     item={**item, "arguments": "", "status": "in_progress"})
            for piece in _pieces(item["arguments"]):
                yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=idx, delta=piece)
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                     arguments=item["arguments"], name=item["name"])
        else:
            yield ev("response.output_item.added", output_index=idx, item=item)
        yield ev("response.output_item.done", output_index=idx, item=item)
    final = responses_response(req, r)
    yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


# -- Anthropic Messages --------------------------------------------------------------------------


def _anthropic_text(content: JSON, where: str) -> str:
    return _text_of(content, where, ok=("text",))


def parse_messages(body: dict, count_only: bool = False) -> Request:
    model = _need(body, "model", str)
    if not count_only:
        _need(body, "max_tokens", int)
    raw = _need(body, "messages", list)
    if not raw:
        raise WireError(400, "messages: must not be empty")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _anthropic_text(system, "system")})
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if isinstance(m, dict) and m.get("role") == "system":  # a system turn mid-conversation (Claude Code sends one)
            messages.append({"role": "system", "content": _anthropic_text(m.get("content", ""), f"{where}.content")})
            continue
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise WireError(400, f"{where}.role: must be user, assistant or system")
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise WireError(400, f"{where}.content: expected a string or a list of blocks")
        text, calls, results = [], [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": _need(b, "name", str, f"{where}.content.{j}."),
                                           "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and m["role"] == "user":
                res, at = b.get("content"), f"{where}.content.{j}"
                results.append({"role": "tool", "tool_call_id": _need(b, "tool_use_id", str, f"{at}."),
                                "content": res if isinstance(res, str) else _anthropic_text(res, at)})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue
            else:
                raise WireError(400, f"{where}.content.{j}.type: unsupported block {kind!r} for role {m['role']}")
        messages += results
        if text or calls or not results:
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
    tools: list[dict[str, Any]] | None = None
    if body.get("tools"):
        tools = []
        for i, t in enumerate(_need(body, "tools", list)):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise WireError(400, f"tools.{i}.name: field required")
            tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema", {})}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "none":
        tools = None
    return Request("messages", model, messages, tools, stop=_stops(body.get("stop_sequences")),
                   stream=bool(_opt(body, "stream", bool, False)), session_hint=_metadata_session(body, "user_id"),
                   **_sampling(body, ("max_tokens",)))


def _anthropic_stop(r: Reply) -> tuple[str, str | None]:
    if r.parsed.tool_calls:
        return "tool_use", None
    if r.finish == "length":
        return "max_tokens", None
    if r.matched_stop:
        return "stop_sequence", r.matched_stop
    return "end_turn", None


def _anthropic_blocks(r: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if r.parsed.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": r.parsed.reasoning, "signature": ""})
    if r.parsed.text or not r.parsed.tool_calls:
        blocks.append({"type": "text", "text": r.parsed.text})
    for c in r.parsed.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.input})
    return blocks


def messages_response(req: Request, r: Reply) -> dict[str, Any]:
    stop, seq = _anthropic_stop(r)
    return {"id": f"msg_{r.id}", "type": "message", "role": "assistant", "model": req.model,
            "content": _anthropic_blocks(r), "stop_reason": stop, "stop_sequence": seq,
            "usage": _anthropic_usage(r, r.completion_tokens)}


def _anthropic_usage(r: Reply, output_tokens: int) -> dict[str, int]:
    """Anthropic counts prompt tokens read from the cache apart from ``input_tokens``."""
    return {"input_tokens": r.prompt_tokens - r.cached_tokens, "cache_read_input_tokens": r.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": output_tokens}


def messages_stream(req: Request, r: Reply) -> Iterator[bytes]:
    def ev(kind: str, **data: Any) -> bytes:
        return _sse(kind, {"type": kind, **data})

    start = messages_response(req, r)
    yield ev("message_start", message={**start, "content": [], "stop_reason": None, "stop_sequence": None,
                                       "usage": _anthropic_usage(r, 0)})
    for i, b in enumerate(_anthropic_blocks(r)):
        if b["type"] == "text":
            yield ev("content_block_start", index=i, content_block={"type": "text", "text": ""})
            for piece in _pieces(b["text"]):
                yield ev("content_block_delta", index=i, delta={"type": "text_delta", "text": piece})
        elif b["type"] == "thinking":
            yield ev("content_block_start", index=i,
                     content_block={"type": "thinking", "thinking": "", "signature": ""})
            for piece in _pieces(b["thinking"]):
                yield ev("content_block_delta", index=i, delta={"type": "thinking_delta", "thinking": piece})
            yield ev("content_block_delta", index=i, delta={"type": "signature_delta", "signature": ""})
        else:
            yield ev("content_block_start", index=i, content_block={**b, "input": {}})
            for piece in _pieces(json.dumps(b["input"])):
                yield ev("content_block_delta", index=i, delta={"type": "input_json_delta", "partial_json": piece})
        yield ev("content_block_stop", index=i)
    yield ev("message_delta", delta={"stop_reason": start["stop_reason"], "stop_sequence": start["stop_sequence"]},
             usage={"output_tokens": r.completion_tokens})
    yield ev("message_stop")


# -- errors --------------------------------------------------------------------------------------

_ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def error_body(api: str, e: WireError) -> dict[str, Any]:
    if api == "messages":
        kind = e.kind if e.kind in _ANTHROPIC_KINDS.values() else _ANTHROPIC_KINDS.get(e.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": e.message}}
    code = e.code or ("invalid_api_key" if e.status == 401 else None)
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": code}}
