"""The embedded engine's weight routes: updates from disk, tensors (CUDA IPC / shared memory) and a broadcast
group, versions, checksums. Answers as SGLang 0.5.23 gives them: ``{"success", "message"}`` with 200, or 400 and
success false; tensor and distributed updates only inside a ``/begin_weight_update`` ... ``/end_weight_update``
session. A mixin of `EngineServer`, whose ``s`` (the scheduler), ``groups``, ``session``, ``_json`` and
``_call`` it uses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from rlx.rollout.engines.embedded import weights as W
from rlx.rollout.engines.embedded.answers import BadRequest, result
from rlx.transport.group import DEFAULT_GROUP

if TYPE_CHECKING:
    from rlx.rollout.engines.embedded.scheduler import Scheduler

T = TypeVar("T")


class WeightRoutes:
    # Answers as SGLang 0.5.23 gives them: {"success", "message"} with 200, or 400 and success false;
    # tensor and distributed updates only inside a /begin_weight_update ... /end_weight_update session.

    # what `EngineServer` holds and provides
    s: Scheduler
    groups: dict[str, W.BroadcastGroup]  # weight-update groups by name (one per sending rank)
    session: bool  # inside /begin_weight_update ... /end_weight_update
    server_args: dict[str, Any]
    if TYPE_CHECKING:
        async def _json(self, request: web.Request) -> dict[str, Any]: ...

        async def _call(self, fn: Callable[[], T]) -> T: ...

    def _updated(self, message: str, body: dict[str, Any], **extra: Any) -> web.Response:
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return result(True, message, **extra)

    async def _update(self, body: dict[str, Any], load) -> int:
        def apply():
            if body.get("abort_all_requests"):
                self.s._abort(None, "Aborted")
            n = load()
            self.s.clear_prefix_cache()  # KV computed with other weights
            v = body.get("weight_version")
            if v is not None:
                self.s.weight_version = str(v)
            return n

        return await self._call(apply)

    def _need_session(self, what: str) -> web.Response | None:
        if not self.session:
            return result(False, f"{what} must run between begin_weight_update() and end_weight_update()")
        return None

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await self._json(request)
        if self.session:
            return result(False, "a weight update session is already open")
        self.session = True
        return result(True, "Weight update session started.")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await self._json(request)
        if not self.session:
            return result(False, "no weight update session is open")
        self.session = False
        return result(True, "Weight update session ended.")

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        path = body.get("model_path")
        if not path:
            raise BadRequest("model_path is required")
        try:
            await self._update(body, lambda: W.load_from_disk(self.s.model, path))
        except W.WeightError as e:
            return result(False, f"Failed to update weights: {e}.", num_paused_requests=0)
        return self._updated("Succeeded to update model weights.", body, num_paused_requests=0)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if (refused := self._need_session("update_weights_from_tensor")) is not None:
            return refused
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads:
            raise BadRequest("serialized_named_tensors must be a non-empty list, one payload per TP rank")
        if body.get("load_format") not in (None, "direct"):
            raise BadRequest(f"load_format {body['load_format']!r} is not supported by the embedded engine")
        # One payload per tensor-parallel rank (SGLang reads serialized_named_tensors[tp_rank]); this
        # engine is TP rank 0 of 1.
        try:
            named = await asyncio.to_thread(W.deserialize_named_tensors, payloads[0])
            await self._update(body, lambda: W.load_named(self.s.model, named))
        except W.WireError as e:
            return result(False, f"Failed to update weights: {e}")
        return self._updated("Success", body)

    async def init_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        try:
            args = dict(master_address=body["master_address"], master_port=int(body["master_port"]),
                        rank=int(body["rank_offset"]) + 0,  # rank_offset + tp_rank, as SGLang's ranks join
                        world_size=int(body["world_size"]),
                        group_name=body.get("group_name", DEFAULT_GROUP),
                        backend=body.get("backend", "nccl"), local_address=self.server_args.get("host"))
        except (KeyError, ValueError) as e:
            raise BadRequest(f"init_weights_update_group needs master_address, master_port, rank_offset, "
                             f"world_size: {e}") from None
        try:
            self.groups[args["group_name"]] = await asyncio.to_thread(W.BroadcastGroup, **args)
        except Exception as e:
            return result(False, f"Failed to initialize custom process group: {type(e).__name__}: {e}.")
        return result(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        name = body.get("group_name", DEFAULT_GROUP)
        if self.groups.pop(name, None) is None:
            return result(False, f"Failed to destroy custom process group: no group {name!r}.")
        return result(True, "Succeeded to destroy custom process group.")

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if body.get("new_version") is None:
            raise BadRequest("new_version is required")

        def apply():
            if body.get("abort_all_requests", True):  # SGLang's default aborts everything
                self.s._abort(None, "Aborted")
            self.s.weight_version = str(body["new_version"])

        await self._call(apply)
        v = self.s.weight_version
        return web.json_response({"success": True, "message": f"Weight version updated to {v}", "new_version": v})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if (refused := self._need_session("update_weights_from_distributed")) is not None:
            return refused
        name = body.get("group_name", DEFAULT_GROUP)
        group = self.groups.get(name)
        if group is None:
            return result(False, f"Group {name} not in model update groups; call /init_weights_update_group")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise BadRequest("names, dtypes and shapes are required lists")
        # Receive outside the scheduler thread (generation goes on), then swap in between two steps.
        try:
            named = await asyncio.to_thread(group.receive, names, dtypes, shapes)
            await self._update(body, lambda: W.load_named(self.s.model, named))
        except W.WeightError as e:
            return result(False, f"Failed to update parameter online: {e}")
        return self._updated("Succeeded to update parameter online.", body)

    # -- LoRA adapters (SGLang's routes with --enable-lora; answers are its LoRAUpdateOutput) ------------------------

    def _lora_answer(self, error: str | None = None) -> web.Response:
        loaded = dict(self.s.adapters.loaded) if self.s.adapters is not None else {}
        return web.json_response({"success": error is None, "error_message": error, "loaded_adapters": loaded},
                                 status=200 if error is None else 400)

    async def _load_adapter(self, name: Any, read: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
                            source: str) -> web.Response:
        adapters = self.s.adapters
        if adapters is None:
            return self._lora_answer("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if not isinstance(name, str) or not name:
            raise BadRequest("lora_name is required")
        try:
            config, tensors = await asyncio.to_thread(read)
            await self._call(lambda: adapters.load(name, config, tensors, source))
        except W.WireError as e:  # (AdapterError too)
            return self._lora_answer(str(e))
        return self._lora_answer()

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """A peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) at ``lora_path``."""
        body = await self._json(request)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("lora_path is required")
        return await self._load_adapter(body.get("lora_name"), lambda: W.read_adapter(path), path)

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        """``serialized_named_tensors`` (one payload per TP rank: this engine reads the first) holds a dict of the
        adapter's tensors; with ``expected_checksums`` (sha256 of each tensor's bytes) an adapter whose tensors differ
        is refused (SGLang 0.5.23's TP worker raises on it instead, which stops its server)."""
        body = await self._json(request)
        payloads, config = body.get("serialized_named_tensors"), body.get("config_dict")
        if not isinstance(payloads, list) or not payloads:
            raise BadRequest("serialized_named_tensors must be a non-empty list, one payload per TP rank")
        if not isinstance(config, dict):
            raise BadRequest("config_dict (the adapter's peft adapter_config) is required")
        return await self._load_adapter(body.get("lora_name"), lambda: (config, W.received_adapter(
            payloads[0], body.get("expected_checksums"))), "__tensor__")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """New requests may no longer name the adapter; it goes, and the answer comes, once those naming it finish."""
        body = await self._json(request)
        name, adapters = body.get("lora_name"), self.s.adapters
        if adapters is None:
            return self._lora_answer("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if not isinstance(name, str):
            raise BadRequest("lora_name is required")
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def done() -> None:
            loop.call_soon_threadsafe(_done, gone)

        try:
            await self._call(lambda: adapters.unload(name, done))
        except W.WireError as e:
            return self._lora_answer(str(e))
        await gone
        return self._lora_answer()

    async def weights_checksum(self, request: web.Request) -> web.Response:
        """rlx's own route (SGLang has none): per-tensor hashes of the served weights by HF name, which a
        trainer can recompute from what it sent, for exact verification; with ``lora_name``, of that adapter's
        tensors by peft's names."""
        body = await self._json(request)
        names = body.get("names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise BadRequest("names: a list of weight names, or null for all")
        head = body.get("head")
        if head is not None and not (isinstance(head, int) and head > 0):
            raise BadRequest("head: a positive number of leading values, or null for whole tensors")
        lora, adapters = body.get("lora_name"), self.s.adapters
        if lora is not None:  # a LoRA adapter's tensors, by peft's names, instead of the weights
            if adapters is None or lora not in adapters.loaded:
                raise BadRequest(f"LoRA adapter {lora} is not loaded")
            return web.json_response(await self._call(lambda: W.checksums(None, names, head,
                                                                          adapters.tensors(lora))))
        return web.json_response(await self._call(lambda: W.checksums(self.s.model, names, head)))

    async def weights_checker(self, request: web.Request) -> web.Response:
        """SGLang's ``/weights_checker`` (0.5.23), action ``checksum``: per-parameter hashes per TP rank and
        one per engine; the other actions (snapshot, reset_tensors, compare) are not served here."""
        body = await self._json(request)
        action = body.get("action", "checksum")
        if action != "checksum":
            return result(False, f"action {action!r} is not supported by the embedded engine (checksum is)")
        sums = (await self._call(lambda: W.checksums(self.s.model, None)))["checksums"]
        import hashlib

        per_gpu = hashlib.sha256("".join(n + sums[n] for n in sorted(sums)).encode()).hexdigest()
        info = [{"role": "tp", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                 "rank": 0, "size": 1}]
        return result(True, "checksum", ranks=[{"checksums": sums, "per_gpu_checksum": per_gpu,
                                                      "parallelism_info": info}],
                            per_engine_checksum=hashlib.sha256(per_gpu.encode()).hexdigest())

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await self._json(request) if request.method == "POST" else dict(request.query)
        if "name" not in body:
            raise BadRequest("name is required")
        # SGLang implements this for the Llama, Granite and OPT families only (Qwen2/Qwen3 answer 400).
        archs = set(getattr(self.s.model.config, "architectures", None) or [])
        if not archs & W.BY_NAME_ARCHITECTURES:
            raise BadRequest("Get parameter by name failed")
        try:
            values = await self._call(lambda: W.weights_by_name(self.s.model, body["name"],
                                                                 int(body.get("truncate_size", 100))))
        except W.WeightError:
            raise BadRequest("Get parameter by name failed") from None
        return web.json_response(values)


def _done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
