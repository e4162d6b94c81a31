"""The wire format of tensor weight updates (SGLang's ``/update_weights_from_tensor``), both ends.

A payload is a pickled list of ``(name, tensor)`` pairs, base64-encoded for JSON. CPU tensors travel
by value; CUDA tensors through torch's reductions become IPC handles, so a colocated engine maps the
trainer's memory instead of copying it over HTTP.
"""

from __future__ import annotations

import base64
import pickle

import torch


class WireError(ValueError):
    """A payload that cannot be decoded into named tensors."""


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """The client side of ``/update_weights_from_tensor``: pickled pairs, base64 for JSON.

    CPU tensors travel by value; CUDA tensors through torch's reductions become IPC handles, so a
    colocated engine maps the trainer's memory instead of copying it over HTTP.
    """
    if any(t.is_cuda for _, t in named):
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers torch's CUDA IPC reductions)

        return base64.b64encode(ForkingPickler.dumps(named)).decode()
    return base64.b64encode(pickle.dumps([(n, _own_storage(t.detach().cpu())) for n, t in named])).decode()


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy when it is a view into a larger storage: pickle writes a view's whole storage, and
    megatron's parameters are views into one buffer holding the entire model."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    named = pickle.loads(base64.b64decode(payload))
    if not isinstance(named, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in named):
        raise WireError("serialized_named_tensors must decode to a list of (name, tensor) pairs")
    return named


def tensor_hash(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """A hash of a tensor's bytes as `dtype` (default its own): what the trainer sent and what the engine
    holds compare equal exactly when the engine serves those bytes."""
    import hashlib

    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    raw = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()
