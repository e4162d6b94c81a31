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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from rlx.errors import EngineError
from rlx.types import GenerateResult as GenerateResult  # re-exported: a generation's result is a type

if TYPE_CHECKING:
    from rlx.types import JSON


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k, min_p,
    # max_new_tokens, stop, stop_token_ids, n, ignore_eos, skip_special_tokens
    return_logprob: bool = True
    rid: str | None = None
    # SGLang >= 0.5.6 launched with --enable-return-routed-experts: report the experts each token was routed to
    return_routed_experts: bool = False
    lora_path: str | None = None  # the LoRA adapter (by its loaded name) to generate with; None: the base model
    lora_version: int = 0  # the policy version of that adapter (rlx's; not sent)

    def to_json(self) -> dict[str, Any]:
        # not dataclasses.asdict (its generic deep copy cost 0.1 ms a request on the driver); still a copy: the ids,
        # the parameters and their lists (stop strings and ids)
        params = {k: list(v) if isinstance(v, list) else v for k, v in self.sampling_params.items()}
        d: dict[str, Any] = {"input_ids": list(self.input_ids), "sampling_params": params,
                             "return_logprob": self.return_logprob}
        if self.rid is not None:
            d["rid"] = self.rid
        if self.return_routed_experts:  # a field older servers do not know
            d["return_routed_experts"] = True
        if self.lora_path is not None:
            d["lora_path"] = self.lora_path
        return d


class EngineClient:
    """SGLang's native API at one base URL (an engine or a router)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 keep_open: bool = False):
        """`keep_open`: ``async with`` leaves the client (and its connections) open for the next caller; its
        owner calls `close`."""
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.keep_open = keep_open

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self.keep_open:
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
            # a kept-open client holds idle connections for less than servers keep them (uvicorn, SGLang's
            # server: 5 s), so that its next request never goes out on one the server has just closed
            keep: dict[str, Any] = {"keepalive_timeout": 4.0} if self.keep_open else {}
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0, force_close=False, **keep)
            )
        return self._session

    async def request(self, method: str, path: str, body: JSON = None, *, retries: int = 0,
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

    async def score(self, input_ids: list[int], start: int, top_k: int = 0, *, retries: int = 0
                    ) -> tuple[list[float], list[list[tuple[float, int]]]]:
        """The model's log-prob of each token of `input_ids` from `start` on (``start >= 1``), given those before,
        and with `top_k` its `top_k` (log-prob, id) pairs at each of those positions: SGLang's prompt log-probs (a
        request generating nothing, ``logprob_start_len`` one before `start`; no temperature)."""
        body = {"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": start - 1, **({"top_logprobs_num": top_k} if top_k else {})}
        out = await self.request("POST", "/generate", body, retries=retries)
        meta = (out[0] if isinstance(out, list) else out).get("meta_info", {})
        lps = meta.get("input_token_logprobs") or []
        n = len(input_ids) - start
        if len(lps) != n + 1:
            raise EngineError(f"engine at {self.base_url} scored {len(lps) - 1} tokens of {n} (input_token_logprobs "
                              f"from logprob_start_len {start - 1})")
        tops = (meta.get("input_top_logprobs") or [None])[1:] if top_k else []
        if top_k and len(tops) != n:
            raise EngineError(f"engine at {self.base_url} gave top log-probs at {len(tops)} positions of {n}")
        return [float(x[0]) for x in lps[1:]], [[(float(t[0]), int(t[1])) for t in row] for row in tops]

    # -- status ----------------------------------------------------------------------------------

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            await self.request("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    async def model_info(self) -> dict[str, Any]:
        return await self._get_either("/model_info", "/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._get_either("/server_info", "/get_server_info")

    async def cpu_seconds(self) -> float | None:
        """CPU seconds the engine process has used (``process_cpu_seconds_total`` in ``/metrics``); None where the
        engine does not report it (SGLang without ``--enable-metrics``, or in multiprocess mode)."""
        try:
            text = await self.request("GET", "/metrics")
        except EngineError:
            return None
        for line in str(text).splitlines():
            if line.startswith("process_cpu_seconds_total "):
                return float(line.split()[1])
        return None

    async def _get_either(self, new: str, old: str) -> dict[str, Any]:
        try:
            return await self.request("GET", new)
        except EngineError as e:
            if e.status != 404:
                raise
            return await self.request("GET", old)

    async def context_length(self) -> int | None:
        """The model's context length as the engine enforces it (``/v1/models`` ``max_model_len``, served by
        SGLang 0.5.5+ and the embedded engine); None when the engine does not say."""
        try:
            models = await self.request("GET", "/v1/models")
            return int(models["data"][0]["max_model_len"])
        except (EngineError, KeyError, IndexError, TypeError, ValueError):
            return None

    async def weight_version(self) -> str:
        return str((await self.model_info()).get("weight_version", ""))

    # -- control ---------------------------------------------------------------------------------

    async def abort(self, rid: str | None = None) -> Any:
        body = {"rid": rid} if rid is not None else {"abort_all": True, "rid": ""}
        return await self.request("POST", "/abort_request", body)

    async def pause(self, mode: str = "abort") -> Any:
        """Pause generation. ``mode`` (abort, retract, in_place) is read by SGLang from 0.5.6; older versions
        take no body and always abort what is running (rlx resumes aborted samples as partial rollouts)."""
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> Any:
        return await self.request("POST", "/continue_generation", {})

    async def flush_cache(self) -> Any:
        return await self.request("POST", "/flush_cache")

    async def release_memory(self, tags: list[str] | None = None) -> Any:
        """Free GPU memory (weights, KV cache); SGLang frees nothing unless launched with
        ``--enable-memory-saver`` and requires an idle server (pause first)."""
        return await self.request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> Any:
        return await self.request("POST", "/resume_memory_occupation", {"tags": tags})

    async def tp_size(self) -> int:
        """The engine's tensor-parallel size (``tp_size`` in its server info; 1 when not reported)."""
        return int((await self.server_info()).get("tp_size") or 1)

    # -- weights ---------------------------------------------------------------------------------

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       abort_all_requests: bool = False) -> Any:
        return _checked(await self.request("POST", "/update_weights_from_disk", {
            "model_path": model_path, "weight_version": weight_version,
            "abort_all_requests": abort_all_requests}), self.base_url)

    async def begin_weight_update(self) -> bool:
        """Open a tensor/distributed weight-update session (SGLang 0.5.23 refuses those updates outside
        one); False where the engine has no sessions (0.5.5: 404), which then needs none."""
        try:
            _checked(await self.request("POST", "/begin_weight_update", {}), self.base_url)
            return True
        except EngineError as e:
            if e.status == 404:
                return False
            raise

    async def end_weight_update(self) -> Any:
        return _checked(await self.request("POST", "/end_weight_update", {}), self.base_url)

    async def update_weights_from_tensor(self, serialized: list[str], weight_version: str | None = None,
                                         flush_cache: bool = True) -> Any:
        """`serialized`: one payload per TP rank of the engine (SGLang's rank i reads element i)."""
        return _checked(await self.request("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": serialized, "load_format": None, "weight_version": weight_version,
            "flush_cache": flush_cache, "abort_all_requests": False}), self.base_url)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> Any:
        return _checked(await self.request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}), self.base_url)

    async def destroy_weights_update_group(self, group_name: str) -> Any:
        return _checked(await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name}),
                        self.base_url)

    async def alive(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers HTTP at all (any status) within `timeout_s`: a liveness probe that, unlike
        SGLang's ``/health`` (which generates a token), also passes while the engine is paused or busy with a
        weight update. A dead or frozen (SIGSTOP) process does not answer."""
        try:
            async with self._sess().get(f"{self.base_url}/model_info",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                return True
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            return False

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: str | None = None) -> Any:
        return _checked(await self.request("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "weight_version": weight_version, "flush_cache": True, "abort_all_requests": False}), self.base_url)

    async def update_weight_version(self, version: str, abort_all_requests: bool = False) -> Any:
        """Set the served weight version once every part of a push has arrived."""
        return _checked(await self.request("POST", "/update_weight_version", {
            "new_version": version, "abort_all_requests": abort_all_requests}), self.base_url)

    # -- LoRA adapters (SGLang launched with --enable-lora) ------------------------------------------

    async def load_lora_adapter(self, name: str, path: str) -> Any:
        """Serve the peft adapter in folder `path` as `name` (requests name it as ``lora_path``)."""
        return _lora(await self.request("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path}),
                     self.base_url)

    async def load_lora_adapter_from_tensors(self, name: str, config: dict[str, Any], serialized: list[str],
                                             expected_checksums: dict[str, str] | None = None) -> Any:
        """Serve a peft adapter sent as tensors: `config` its ``adapter_config``, `serialized` one payload per TP rank
        (`rlx.transport.payloads.serialize_tensor_dict`); with `expected_checksums` (sha256 of each tensor's bytes,
        `rlx.transport.payloads.sha256`) the engine checks the adapter arrived intact (the embedded engine refuses one that
        did not; SGLang 0.5.23's TP worker raises, which stops its server)."""
        body = {"lora_name": name, "config_dict": config, "serialized_named_tensors": serialized}
        if expected_checksums is not None:
            body["expected_checksums"] = expected_checksums
        return _lora(await self.request("POST", "/load_lora_adapter_from_tensors", body), self.base_url)

    async def unload_lora_adapter(self, name: str) -> Any:
        """Stop serving adapter `name`: new requests may no longer name it, and it goes once those that do finish
        (SGLang answers then)."""
        return _lora(await self.request("POST", "/unload_lora_adapter", {"lora_name": name}), self.base_url)

    async def weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        """Per-tensor hashes of the served weights by HF name (rlx's embedded engine; a 404 elsewhere)."""
        return await self.request("POST", "/weights_checksum", {"names": names})

    async def weights_checker(self) -> dict[str, Any]:
        """SGLang's ``/weights_checker`` checksum (0.5.23; a 404 on older versions): per TP rank, hashes of
        SGLang's own (fused, sharded) parameters, and ``per_engine_checksum`` over all of them."""
        return _checked(await self.request("POST", "/weights_checker", {"action": "checksum"}), self.base_url)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        """The first `truncate_size` rows of a weight (SGLang: Llama, Granite and OPT families only; other
        models answer 400)."""
        return await self.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})


def _checked(resp: JSON, url: str) -> JSON:
    if isinstance(resp, dict) and resp.get("success") is False:
        raise EngineError(f"engine at {url} refused the weight update: {resp.get('message')}")
    return resp


def _lora(resp: JSON, url: str) -> JSON:
    if isinstance(resp, dict) and resp.get("success") is False:
        raise EngineError(f"engine at {url} refused the LoRA adapter update: {resp.get('error_message')}")
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
