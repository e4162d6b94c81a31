"""The wire format of tensor weight updates (SGLang's ``/update_weights_from_tensor``), both ends.

A payload is a pickled list of ``(name, tensor)`` pairs, base64-encoded for JSON; a request carries one
per TP rank of the engine. CPU tensors travel by value (plain pickle: both SGLang 0.5.5's and 0.5.23's
restricted unpicklers accept it; torch's shared-memory reduction of CPU tensors does not work between
unrelated processes), or, to an engine on the same host, as handles into a shared-memory segment
(`rlx.transport.shm`; only the embedded engine reads those, SGLang serves from GPUs). CUDA tensors travel as IPC handles, so a colocated engine maps the trainer's memory
instead of copying it over HTTP; the device is named by its UUID, as SGLang's patched reductions write and
read it, because trainer and engine may number the GPUs differently (CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import base64
import pickle
import torch

from rlx.transport.shm import Attachments, Segment, WireError


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]], segment: Segment | None = None) -> str:
    """The client side of ``/update_weights_from_tensor``: pickled pairs, base64 for JSON.

    CPU tensors travel by value, or with `segment` as handles into it (copied there now: the segment must
    not be packed again until the engines answered); CUDA tensors through torch's reductions become IPC
    handles, so a colocated engine maps the trainer's memory instead of copying it over HTTP.
    """
    if any(t.is_cuda for _, t in named):
        import io
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers torch's CUDA IPC reductions)

        buf = io.BytesIO()
        pickler = ForkingPickler(buf)
        pickler.dispatch_table.update({torch.Tensor: _reduce_by_uuid, torch.nn.Parameter: _reduce_by_uuid})
        pickler.dump([(n, t.detach()) for n, t in named])
        return base64.b64encode(buf.getvalue()).decode()
    if segment is not None:
        return base64.b64encode(pickle.dumps(segment.pack(named))).decode()
    return base64.b64encode(pickle.dumps([(n, _own_storage(t.detach().cpu())) for n, t in named])).decode()


def _reduce_by_uuid(t: torch.Tensor):
    """torch's reduction of a tensor, with a CUDA tensor's device index (argument 6 of
    ``rebuild_cuda_tensor``) replaced by the device's UUID, as SGLang's patched reductions send it."""
    from torch.multiprocessing.reductions import reduce_tensor

    fn, args = reduce_tensor(t)
    if t.is_cuda:
        args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
    return fn, args


def _device_index(device) -> int:
    """A device index, or the index of the local GPU with this UUID (SGLang's convention)."""
    if not isinstance(device, str):
        return device
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == device:
            return i
    raise WireError(f"no GPU with UUID {device} is visible to this process")


def _rebuild_cuda_tensor(*args):
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*args[:6], _device_index(args[6]), *args[7:])


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, attachments: Attachments):
        super().__init__(file)
        self.attachments = attachments

    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        if (module, name) == ("rlx.transport.shm", "shared_tensor"):
            return self.attachments.tensor
        return super().find_class(module, name)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy when it is a view into a larger storage: pickle writes a view's whole storage, and
    megatron's parameters are views into one buffer holding the entire model."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The engine side. Shared-memory handles become views of the sender's segment, valid until the engine
    answers the request (the sender then packs its next bucket there): copy them into the model first."""
    import io

    try:
        named = _Unpickler(io.BytesIO(base64.b64decode(payload, validate=True)), Attachments()).load()
    except WireError:
        raise
    except (ValueError, pickle.UnpicklingError, EOFError) as e:
        raise WireError(f"serialized_named_tensors: not a base64 pickle of (name, tensor) pairs: {e}") from None
    if not isinstance(named, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in named):
        raise WireError("serialized_named_tensors must decode to a list of (name, tensor) pairs")
    return named


def serialize_tensor_dict(tensors: dict[str, torch.Tensor]) -> str:
    """The payload of SGLang's ``/load_lora_adapter_from_tensors``: a LoRA adapter's tensors as a pickled dict by name,
    base64 for JSON (its loader reads a dict there, where weight updates read (name, tensor) pairs). By value: adapters
    are small."""
    return base64.b64encode(pickle.dumps({n: _own_storage(t.detach().cpu()) for n, t in tensors.items()})).decode()


def save_peft_adapter(folder, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """A LoRA adapter as peft saves it and SGLang's ``/load_lora_adapter`` reads it: ``adapter_model.safetensors`` (peft's
    tensor names) and ``adapter_config.json`` in `folder`."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, str(folder / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))


def deserialize_tensor_dict(payload: str) -> dict[str, torch.Tensor]:
    """The engine side of `serialize_tensor_dict`."""
    import io

    try:
        tensors = _Unpickler(io.BytesIO(base64.b64decode(payload, validate=True)), Attachments()).load()
    except (ValueError, pickle.UnpicklingError, EOFError) as e:
        raise WireError(f"serialized_named_tensors: not a base64 pickle of a dict of tensors: {e}") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise WireError("serialized_named_tensors must decode to a dict of tensors by name (a LoRA adapter's)")
    return tensors


def sha256(t: torch.Tensor) -> str:
    """SGLang's checksum of an adapter tensor as its engine received it (``expected_checksums``): sha256 of its bytes."""
    import hashlib

    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def tensor_hash(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """A hash of a tensor's bytes as `dtype` (default its own): what the trainer sent and what the engine
    holds compare equal exactly when the engine serves those bytes."""
    import hashlib

    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    raw = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()
