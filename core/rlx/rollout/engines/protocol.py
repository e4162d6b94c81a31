"""A typed async client for SGLang's native HTTP API, used for every engine (SGLang or embedded) and
for sglang-router in front of them.

Choices:

* Requests and results are dataclasses; the JSON field names are SGLang's (``input_ids``,
  ``sampling_params``, ``return_logprob``, ``meta_info.output_token_logprobs``, ``finish_reason``).
* A connection failure, a 5xx or a time-out becomes `EngineError` naming the URL and the endpoint,
  so a dead engine is a clear error, never a hang. Retries are the caller's choice (`retries`).
* One aiohttp session per client, created lazily inside the running event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from rlx.errors import RLXError


class EngineError(RLXError):
    """An engine could not be reached, or answered with an error."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k, min_p,
    # max_new_tokens, stop, stop_token_ids, n, ignore_eos, skip_special_tokens
    return_logprob: bool = True
    rid: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.rid is None:
            d.pop("rid")
        return d


@dataclass
class GenerateResult:
    text: str
    output_ids: list[int]
    output_logprobs: list[float]  # one per output id; empty unless return_logprob
    finish_reason: str  # "stop", "length" or "abort"
    matched_stop: int | str | None  # the stop token id or string that ended generation
    weight_version: str
    token_weight_versions: list[str]  # per output id, when the engine reports it
    prompt_tokens: int
    rid: str | None
    raw: dict[str, Any]
    temperature: float | None = None  # the request's sampling temperature (set by the caller)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GenerateResult:
        meta = d.get("meta_info", {})
        fr = meta.get("finish_reason") or {}
        if isinstance(fr, str):
            fr = {"type": fr}
        lps = meta.get("output_token_logprobs") or []
        output_ids = d.get("output_ids")
        if output_ids is None:  # very old servers: ids only inside the logprob triples
            output_ids = [t[1] for t in lps]
        return cls(
            text=d.get("text", ""),
            output_ids=list(output_ids),
            output_logprobs=[float(t[0]) for t in lps],
            finish_reason=fr.get("type", "unknown"),
            matched_stop=fr.get("matched"),
            weight_version=str(meta.get("weight_version", "")),
            token_weight_versions=[str(v) for v in meta.get("output_token_weight_versions", [])],
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            rid=meta.get("id"),
            raw=d,
        )


class EngineClient:
    """SGLang's native API at one base URL (an engine or a router)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, connect_timeout_s: float = 10.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        # A session belongs to the event loop it was made in; a client reused from another loop
        # (e.g. across asyncio.run calls) gets a fresh one.
        if self._session is not None and self._session._loop is not asyncio.get_running_loop():
            self._session = None
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0, force_close=False)
            )
        return self._session

    async def request(self, method: str, path: str, body: Any = None, *, retries: int = 0,
                      timeout_s: float | None = None) -> Any:
        """Send one request; JSON answers are decoded, text answers returned as str."""
        url = f"{self.base_url}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        for attempt in range(retries + 1):
            try:
                async with self._sess().request(method, url, json=body, timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status >= 400:
                        raise EngineError(f"{method} {url} -> HTTP {resp.status}: {_error_text(text)}", resp.status)
                    if resp.content_type == "application/json":
                        return json.loads(text)
                    return text
            except EngineError as e:
                if e.status is not None and e.status < 500 or attempt == retries:
                    raise
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
                if attempt == retries:
                    what = "timed out" if isinstance(e, TimeoutError) else f"unreachable ({type(e).__name__}: {e})"
                    raise EngineError(f"engine at {self.base_url} {what} on {method} {path}") from None
            await asyncio.sleep(min(0.5 * 2**attempt, 5.0))
        raise AssertionError("unreachable")

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest, *, retries: int = 0) -> list[GenerateResult]:
        """Generate; returns one result per sample (``n`` of them)."""
        out = await self.request("POST", "/generate", req.to_json(), retries=retries)
        items = out if isinstance(out, list) else [out]
        return [GenerateResult.from_json(o) for o in items]

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        """Stream partial results (cumulative text and ids) until the engine finishes."""
        body = req.to_json() | {"stream": True}
        url = f"{self.base_url}/generate"
        try:
            async with self._sess().post(url, json=body) as resp:
                if resp.status >= 400:
                    raise EngineError(f"POST {url} -> HTTP {resp.status}: {_error_text(await resp.text())}",
                                      resp.status)
                async for line in resp.content:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    yield GenerateResult.from_json(json.loads(data))
        except (aiohttp.ClientError, ConnectionError) as e:
            raise EngineError(f"engine at {self.base_url} unreachable on stream: {type(e).__name__}: {e}") from None

    # -- status ----------------------------------------------------------------------------------

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            await self.request("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    async def health_generate(self) -> None:
        await self.request("GET", "/health_generate")

    async def model_info(self) -> dict[str, Any]:
        return await self._get_either("/model_info", "/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._get_either("/server_info", "/get_server_info")

    async def _get_either(self, new: str, old: str) -> dict[str, Any]:
        try:
            return await self.request("GET", new)
        except EngineError as e:
            if e.status != 404:
                raise
            return await self.request("GET", old)

    async def weight_version(self) -> str:
        return str((await self.model_info()).get("weight_version", ""))

    # -- control ---------------------------------------------------------------------------------

    async def abort(self, rid: str | None = None) -> Any:
        body = {"rid": rid} if rid is not None else {"abort_all": True, "rid": ""}
        return await self.request("POST", "/abort_request", body)

    async def pause(self, mode: str = "abort") -> Any:
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> Any:
        return await self.request("POST", "/continue_generation", {})

    async def flush_cache(self) -> Any:
        return await self.request("POST", "/flush_cache")

    async def release_memory(self, tags: list[str] | None = None) -> Any:
        return await self.request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> Any:
        return await self.request("POST", "/resume_memory_occupation", {"tags": tags})

    # -- weights ---------------------------------------------------------------------------------

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       abort_all_requests: bool = False) -> Any:
        return _checked(await self.request("POST", "/update_weights_from_disk", {
            "model_path": model_path, "weight_version": weight_version,
            "abort_all_requests": abort_all_requests}), self.base_url)

    async def update_weights_from_tensor(self, serialized: list[str], weight_version: str | None = None,
                                         flush_cache: bool = True) -> Any:
        return _checked(await self.request("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": serialized, "weight_version": weight_version,
            "flush_cache": flush_cache}), self.base_url)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> Any:
        return _checked(await self.request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}), self.base_url)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: str | None = None) -> Any:
        return _checked(await self.request("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "weight_version": weight_version, "flush_cache": True}), self.base_url)

    async def update_weight_version(self, version: str, abort_all_requests: bool = False) -> Any:
        """Set the served weight version once every part of a push has arrived."""
        return _checked(await self.request("POST", "/update_weight_version", {
            "new_version": version, "abort_all_requests": abort_all_requests}), self.base_url)

    async def weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        """Per-tensor hashes of the served weights (rlx's embedded engine; a 404 elsewhere)."""
        return await self.request("POST", "/weights_checksum", {"names": names})

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return await self.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})


def _checked(resp: Any, url: str) -> Any:
    if isinstance(resp, dict) and resp.get("success") is False:
        raise EngineError(f"engine at {url} refused the weight update: {resp.get('message')}")
    return resp


def _error_text(text: str) -> str:
    try:
        d = json.loads(text)
        if isinstance(d, dict):
            err = d.get("error")
            if isinstance(err, dict):
                return str(err.get("message", err))
            return str(err or d.get("message") or d)
    except ValueError:
        pass
    return text.strip()[:500]
