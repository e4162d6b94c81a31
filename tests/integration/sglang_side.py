"""SGLang's side of rlx's SGLang tests, run as a subprocess with SGLang's own code (see rlx.testing.sglang_code).

    python sglang_side.py http RECORDS.json
        Checks each recorded exchange with the embedded engine: the request body with SGLang's request
        types (the /generate schema gate and GenerateReqInput in 0.5.23, GenerateReqInput and SamplingParams
        checks in both, the io_struct input of every control endpoint), and the response with SGLang's API
        types (sglang.api.v1, 0.5.23). Prints {"version", "problems": [...]}.
    python sglang_side.py join HOST PORT RANK_OFFSET TP_RANK WORLD GROUP TENSORS.json
        Joins the weight-update group as one TP rank of an engine through SGLang's own
        init_weights_update_group (its init_custom_process_group and key layout), receives one broadcast
        with SGLang's own receive loop, and prints {"hashes": {name: hash}}.
    python sglang_side.py payloads PAYLOADS.json
        Unpickles a /update_weights_from_tensor request's payloads, element tp_rank for each TP rank, with
        SGLang's loader (MultiprocessingSerializer and its allow-list, _unwrap_tensor), and prints
        {"ranks": [{name: hash}, ...]}.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
import types
from typing import Any

from rlx.testing import sglang_code


def _hash(t) -> str:
    import torch

    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()  # as rlx.transport.payloads.tensor_hash


def _newer() -> bool:
    return tuple(int(x) for x in sglang_code.version().split(".")[:3]) >= (0, 5, 23)


# -- requests and responses ---------------------------------------------------------------------------

_INPUTS = {  # endpoint -> the io_struct class SGLang parses its body into
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",  # 0.5.23; 0.5.5 takes no body
    "/continue_generation": "ContinueGenerationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}
_LORA = {"/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter"}
_SUCCESS_MESSAGE = {"/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
                    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weight_version",
                    "/begin_weight_update", "/end_weight_update", "/weights_checker"}


def _fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__struct_fields__", ()))


def check_request(path: str, body: Any, problems: list[str]) -> None:
    io = sys.modules["sglang.srt.managers.io_struct"]
    if path == "/generate":
        if _newer():
            from sglang.srt.entrypoints.api_contract import generate_contract_error

            err = generate_contract_error(body)
            if err:
                problems.append(f"/generate request refused by SGLang's schema: {err}: {body}")
        unknown = set(body) - _fields(io.GenerateReqInput)
        if unknown:
            problems.append(f"/generate request has fields SGLang ignores: {sorted(unknown)}")
            return
        req = io.GenerateReqInput(**body)
        req.normalize_batch_and_arguments()
        from sglang.srt.sampling.sampling_params import SamplingParams

        for sp in body.get("sampling_params") if isinstance(body.get("sampling_params"), list) else [
                body.get("sampling_params") or {}]:
            try:
                params = SamplingParams(**sp)
                params.verify(1 << 20)
            except (TypeError, ValueError) as e:
                problems.append(f"/generate sampling_params refused by SGLang: {type(e).__name__}: {e}: {sp}")
        return
    name = _INPUTS.get(path)
    if name is None or body is None:
        return
    cls = getattr(io, name, None)
    if cls is None:  # an endpoint this version does not have (e.g. sessions in 0.5.5): checked elsewhere
        return
    unknown = set(body) - _fields(cls)
    if unknown:
        problems.append(f"{path} request has fields SGLang {sglang_code.version()} ignores: {sorted(unknown)}")
        return
    try:
        cls(**body)
    except (TypeError, ValueError) as e:
        problems.append(f"{path} request refused by {name}: {e}: {body}")


def check_response(path: str, method: str, body: Any, status: int, response: Any, stream: list[Any],
                   problems: list[str]) -> None:
    if not _newer():
        return  # sglang.api.v1 arrived after 0.5.5
    from sglang.api.v1 import api_types as A

    def decode(cls, value, what):
        try:
            cls.from_json_value(value)
        except A.JsonContractError as e:
            problems.append(f"{what}: SGLang's {cls.__name__} refuses it: {e}: {json.dumps(value)[:300]}")

    if path in _LORA:  # SGLang's LoRAUpdateOutput, with 200 or 400
        io = sys.modules["sglang.srt.managers.io_struct"]
        try:
            out = io.LoRAUpdateOutput(**response)
            if out.success != (status == 200):
                problems.append(f"{path} answers success {out.success} with status {status}")
        except (TypeError, ValueError) as e:
            problems.append(f"{path} answers {response!r}; SGLang's LoRAUpdateOutput refuses it: {e}")
        return
    if status >= 400:
        if isinstance(response, dict) and isinstance(response.get("error"), dict):
            decode(A.ErrorBody, response["error"], f"{path} error")
        elif not (isinstance(response, dict) and ("error" in response or "success" in response)):
            problems.append(f"{path} error answer is not SGLang's shape: {response!r}")
        return
    if path == "/generate":
        for item in stream or (response if isinstance(response, list) else [response]):
            if "error" in item:
                decode(A.GenerateStreamError, item, "/generate stream error")
            else:
                decode(A.GenerateResponse, item, "/generate result")
        return
    if path in ("/model_info", "/get_model_info"):
        decode(A.GetModelInfoResponse, response, path)
    elif path in ("/server_info", "/get_server_info"):
        decode(A.GetServerInfoResponse, response, path)
    elif path in ("/abort_request", "/health", "/health_generate"):
        if response not in ("", None):
            problems.append(f"{path} answers {response!r}; SGLang answers 200 with an empty body")
    elif path in _SUCCESS_MESSAGE:
        if not (isinstance(response, dict) and isinstance(response.get("success"), bool)
                and isinstance(response.get("message"), str)):
            problems.append(f"{path} answers {response!r}; SGLang answers {{'success': bool, 'message': str}}")
    elif path in ("/release_memory_occupation", "/resume_memory_occupation"):
        if response is not None:
            problems.append(f"{path} answers {response!r}; SGLang answers null")
    elif path in ("/pause_generation", "/continue_generation"):
        if not (isinstance(response, dict) and response.get("status") == "ok"):
            problems.append(f"{path} answers {response!r}; SGLang answers {{'message', 'status': 'ok'}}")


def http(records_path: str) -> dict[str, Any]:
    problems: list[str] = []
    for r in json.loads(open(records_path).read()):
        found: list[str] = []
        check_request(r["path"], r["body"], found)
        if r.get("refused") == "schema":  # sent wrong on purpose: SGLang must refuse it as well
            if not found:
                problems.append(f"{r['path']} request {r['body']} was refused by the embedded engine, not by SGLang")
        else:
            problems += found
        check_response(r["path"], r["method"], r["body"], r["status"], r["response"], r.get("stream") or [], problems)
    return {"version": sglang_code.version(), "problems": problems}


# -- weight-update group ------------------------------------------------------------------------------

def join(host: str, port: int, rank_offset: int, tp_rank: int, world: int, group: str, tensors_path: str):
    import torch
    import torch.distributed as dist

    # An SGLang engine process has its own default group; SGLang asserts that one exists.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = json.loads(open(tensors_path).read())
    if _newer():
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater as Runner
    else:
        from sglang.srt.model_executor.model_runner import ModelRunner as Runner

        # 0.5.5 picks _new_process_group_helper's keyword by comparing version *strings*
        # (str(torch.__version__) >= "2.6"), which torch 2.13 here fails; it ships pinned to torch 2.8,
        # so this process says so.
        torch.__version__ = "2.8.0"
    received: list[Any] = []
    me = types.SimpleNamespace(tp_rank=tp_rank, device="cpu", _model_update_group={},
                               model=types.SimpleNamespace(load_weights=received.extend))
    ok, message = Runner.init_weights_update_group(me, host, port, rank_offset, world, group, backend="gloo")
    if not ok:
        raise SystemExit(f"SGLang's init_weights_update_group failed: {message}")
    names, dtypes, shapes = spec["names"], spec["dtypes"], spec["shapes"]
    if _newer():
        received = Runner.receive_weights_from_distributed(me, names=names, dtypes=dtypes, shapes=shapes,
                                                           group_name=group)
    else:
        ok, message = Runner.update_weights_from_distributed(me, names, dtypes, shapes, group)
        if not ok:
            raise SystemExit(f"SGLang's update_weights_from_distributed failed: {message}")
    assert all(isinstance(t, torch.Tensor) for _, t in received)
    return {"rank": rank_offset + tp_rank, "hashes": {n: _hash(t) for n, t in received}}


# -- tensor payloads ----------------------------------------------------------------------------------

def payloads(path: str) -> dict[str, Any]:
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    if _newer():
        from sglang.srt.model_executor.model_runner_components.weight_updater import _unwrap_tensor
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payload
    else:
        from sglang.srt.model_executor.model_runner import _unwrap_tensor

        def normalize_serialized_named_tensor_payload(data):
            return data

    body = json.loads(open(path).read())
    serialized = body["serialized_named_tensors"]
    ranks = []
    for tp_rank in range(body["tp_size"]):
        monkey_patch_torch_reductions()
        named = MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(serialized[tp_rank]))
        ranks.append({n: _hash(_unwrap_tensor(t, tp_rank=tp_rank, device="cpu")) for n, t in named})
    return {"ranks": ranks}


# -- LoRA adapters from tensors ------------------------------------------------------------------------

def lora(path: str) -> dict[str, Any]:
    """What SGLang's TP worker makes of a ``/load_lora_adapter_from_tensors`` body: its own deserialization and
    checksum check, then the tensors and config it hands its LoRA manager (whose config class reads the config).
    ``tp_worker.py`` imports the whole scheduler (GPU kernels the stand-ins cannot carry), so its two methods are
    taken from its source text and run with the names they use."""
    import ast
    import importlib.util
    import logging
    import types

    import torch
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    source = Path(importlib.util.find_spec("sglang.srt.managers.tp_worker").origin).read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "BaseTpWorker")
    names = {"MultiprocessingSerializer": MultiprocessingSerializer, "get_parallel": get_parallel, "torch": torch,
             "monkey_patch_torch_reductions": monkey_patch_torch_reductions, "logger": logging.getLogger("tp_worker"),
             "FlattenedTensorBucket": FlattenedTensorBucket}
    wanted = [f for f in cls.body if isinstance(f, ast.FunctionDef)
              and f.name in ("deserialize_own_rank", "load_lora_adapter_from_tensors")]
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "tp_worker.py", "exec"), names)
    BaseTpWorker = types.SimpleNamespace(**{f.name: names[f.name] for f in wanted})  # noqa: N806

    io = sys.modules["sglang.srt.managers.io_struct"]
    req = io.LoadLoRAAdapterFromTensorsReqInput(**json.loads(open(path).read()))
    req.serialized_named_tensors = normalize_serialized_named_tensor_payloads(req.serialized_named_tensors)
    req.lora_id = "id-0"  # (the tokenizer manager's, before it hands the request to the workers)
    got: dict[str, Any] = {}
    runner = types.SimpleNamespace(load_lora_adapter_from_tensors=lambda ref, tensors, config, added: got.update(
        name=ref.lora_name, tensors=tensors, config=config))
    worker = types.SimpleNamespace(model_runner=runner)
    worker.deserialize_own_rank = lambda payloads: BaseTpWorker.deserialize_own_rank(worker, payloads)
    ranks = []
    for tp_rank in range(len(req.serialized_named_tensors)):  # each TP rank reads its own payload
        try:
            with get_parallel().override(tp_rank=tp_rank, tp_size=len(req.serialized_named_tensors)):
                BaseTpWorker.load_lora_adapter_from_tensors(worker, req)
        except RuntimeError as e:
            return {"refused": str(e)}
        config = LoRAConfig.from_dict(got["config"])
        ranks.append({"name": got["name"], "hashes": {n: _hash(t) for n, t in got["tensors"].items()},
                      "r": config.r, "alpha": config.lora_alpha, "targets": sorted(config.target_modules)})
    return {"ranks": ranks}


def main(argv: list[str]) -> None:
    sglang_code.load()
    cmd = argv[0]
    if cmd == "http":
        out = http(argv[1])
    elif cmd == "join":
        host, port, offset, tp_rank, world, group, tensors = argv[1:]
        out = join(host, int(port), int(offset), int(tp_rank), int(world), group, tensors)
    elif cmd == "payloads":
        out = payloads(argv[1])
    elif cmd == "lora":
        out = lora(argv[1])
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
