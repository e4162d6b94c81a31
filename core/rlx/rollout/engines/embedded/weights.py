"""Weight updates for the embedded engine: from disk, from serialized tensors, and by broadcast.

The same three ways SGLang takes weights, with the same request fields. The broadcast group is built
from a ``TCPStore`` and a process group object directly (not ``init_process_group``), so neither side
gives up its default group: the trainer keeps Megatron's, the engine has none. The trainer is rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlx.transport.payloads import WireError, deserialize_named_tensors, deserialize_tensor_dict, sha256

__all__ = ["BY_NAME_ARCHITECTURES", "BroadcastGroup", "WeightError", "WireError", "received_adapter", "checksums",
           "deserialize_named_tensors", "load_from_disk", "load_named", "move_held", "name_as_checkpoint",
           "read_adapter", "serve_quantized", "served_state", "weights_by_name"]

# SGLang reads dtypes with getattr(torch, name): bare names only ("bfloat16", never "torch.bfloat16").
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "float8_e4m3fn": torch.float8_e4m3fn}


class WeightError(WireError):
    """A weight update that cannot be applied (unknown name, wrong shape, unreadable file)."""


def served_state(model: torch.nn.Module, held: bool = True) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names, as views of what it serves with.

    transformers 5 keeps a layer's routed experts fused in memory (``experts.gate_up_proj`` [E, 2I, H] with gate
    before up, ``experts.down_proj`` [E, H, I]) but reads and writes checkpoints per expert
    (``experts.{e}.{gate,up,down}_proj.weight``), which is also how trainers push them. Those per-expert names
    are views into the fused tensors, so an update by name writes straight into them; the fused names are not
    listed. Tied weights appear under every name they have. Names transformers changed on load are the checkpoint's
    again (`name_as_checkpoint`). With `held`, what the engine holds beside the model under those names (quantised
    weights as pushed, MTP layers) stands in for them (`serve_quantized`, `load_named`).
    """
    # peft's LoRA layers (`lora.Adapters`) hold the weight they adapt as base_layer; their adapters are not weights
    state = {n.replace(".base_layer.", "."): t for n, t in model.state_dict(keep_vars=True).items()
             if ".lora_A." not in n and ".lora_B." not in n}
    out: dict[str, torch.Tensor] = {}

    def fused(prefix: str) -> bool:  # [E, 2I, H] gate_up beside [E, H, I] down: the layout these views assume
        gu, d = state.get(prefix + ".gate_up_proj"), state.get(prefix + ".down_proj")
        return (gu is not None and d is not None and gu.dim() == d.dim() == 3 and gu.shape[0] == d.shape[0]
                and gu.shape[1] == 2 * d.shape[2] and gu.shape[2] == d.shape[1])

    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("experts") and leaf in ("gate_up_proj", "down_proj") and fused(prefix):
            for e in range(t.shape[0]):
                if leaf == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e]
                else:
                    gate, up = t[e].chunk(2, 0)
                    out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        else:
            out[name] = t
    renamed: dict[str, str] = getattr(model, "rlx_checkpoint_names", {})  # (`name_as_checkpoint`)
    out = {renamed.get(n, n): t for n, t in out.items()} if renamed else out
    return {**out, **getattr(model, "rlx_held", {})} if held else out


def read_adapter(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A peft adapter folder: its ``adapter_config.json`` and tensors (``adapter_model.safetensors``)."""
    import json

    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        return config, load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise WeightError(f"{folder}: not a peft adapter folder (adapter_config.json, adapter_model.safetensors): "
                          f"{e}") from None


def received_adapter(payload: str, expected: dict[str, str] | None) -> dict[str, torch.Tensor]:
    """An adapter's tensors from ``/load_lora_adapter_from_tensors``' payload, checked against ``expected_checksums``
    as SGLang checks them (every tensor listed, none more, sha256 of its bytes equal)."""
    tensors = deserialize_tensor_dict(payload)
    if expected is not None:
        mismatch = [n for n, want in expected.items() if n in tensors and sha256(tensors[n]) != want]
        missing = [n for n in expected if n not in tensors]
        extra = [n for n in tensors if n not in expected]
        if mismatch or missing or extra:
            raise WeightError(f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(expected)} expected: "
                              f"{len(mismatch)} value-diff {mismatch[:5]}, {len(missing)} missing {missing[:5]}, "
                              f"{len(extra)} extra {extra[:5]}")
    return tensors


_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # per-expert leaves, Mixtral's checkpoint names


def name_as_checkpoint(model: Any, folder: str | Path) -> None:  # (a transformers model)
    """Serve `model`'s tensors (`served_state`) under the names of the checkpoint in `folder` it was loaded from, where
    transformers renamed them on load: a vision-language wrapper's ``model.language_model.*`` loaded as its text
    model, Mixtral-style experts (``block_sparse_moe.experts.{e}.w1``). Trainers push by the checkpoint's names, as
    SGLang loads them. The renames are transformers' own (its conversion mapping for the model, as loading applied
    it).

    The checkpoint's multi-token-prediction layers (``layers.{i}`` past the last, which transformers does not load)
    are held as they are stored (FP8 ones dequantised), served and updated by name with the rest: a trainer that
    trains them pushes them (`rlx.train.mtp`), for drafts to use."""
    import re

    from safetensors import safe_open

    from rlx.models.fp8 import SCALE, block_size, dequantize, is_fp8

    text = model.config.get_text_config()
    extra = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    fp8 = block_size(folder)
    like = next(model.parameters())
    files: dict[str, Path] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            files.update(dict.fromkeys(h.keys(), f))

    def read(key: str) -> torch.Tensor:
        with safe_open(str(files[key]), framework="pt") as h:
            return h.get_tensor(key)

    held: dict[str, torch.Tensor] = {}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversion mappings renames nothing
        return
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    state = served_state(model)
    meta = model.state_dict()
    aliases: dict[str, str] = {}
    for key in files:
        layer = extra.search(key)
        if (getattr(text, "num_nextn_predict_layers", 0) and layer and int(layer[1]) >= text.num_hidden_layers
                and key not in state and not key.endswith(SCALE)):
            t = read(key)
            if is_fp8(t) and fp8 is not None:
                t = dequantize(t, read(key + SCALE), fp8)
            held[key] = t.to(device=like.device, dtype=like.dtype)
        if key in state or key in held:
            continue
        name, _ = rename_source_key(key, renamings, [], model.base_model_prefix, meta)
        name = re.sub(r"(\.experts\.\d+\.)(w[123])(\.weight)$", lambda m: m[1] + _MIXTRAL[m[2]] + m[3], name)
        if name in state and name not in aliases.values():
            aliases[key] = name
    model.rlx_checkpoint_names = {v: k for k, v in aliases.items()}  # the model's name -> the checkpoint's
    model.rlx_held = held


def serve_quantized(model: Any, kind: str, folder: str | Path) -> None:  # (a transformers model, loaded from `folder`)
    """``--quantization fp8|int4`` (SGLang's flag): serve the quantised weights as an engine of that kind holds them,
    served and updated by name (``name`` and its scales), each one's parameter holding their dequantised value, the
    numbers a weight-only kernel computes with; a push of a weight or of its scales dequantises it again
    (`load_named`). FP8: the FP8 checkpoint in `folder`, as stored (float8 and ``weight_scale_inv``; rlx launches FP8
    engines from one). INT4: the model's own weights quantised at start (`rlx.models.int4`)."""
    from rlx.models import int4
    from rlx.models.fp8 import QUANTISED, stored_quantised

    state = served_state(model)
    # the model's own weights: MTP layers the engine holds beside it (`name_as_checkpoint`) stay as it holds them,
    # dequantised (their drafts compute with them; a run that trains them with quantised rollout is refused)
    own = served_state(model, held=False).keys()
    held: dict[str, torch.Tensor] = {}
    if kind == "fp8":
        from safetensors import safe_open

        from rlx.models.fp8 import SCALE, dequantize

        block, names = stored_quantised(folder)
        unknown = sorted(names - state.keys())
        if unknown:
            raise WeightError(f"{folder}: quantised weight {unknown[0]!r} is none of the model's")
        names &= own
        for f in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():
                    if key in names or key.removesuffix(SCALE) in names:
                        held[key] = h.get_tensor(key).to(state[key.removesuffix(SCALE)].device)

        def back(name: str) -> torch.Tensor:
            return dequantize(held[name], held[name + SCALE], block)
    elif kind == "int4":
        SCALE = int4.SCALE
        names = {n for n, t in state.items() if QUANTISED.match(n) and t.dim() == 2 and n in own}
        for name in names:
            held[name], held[name + SCALE] = int4.quantize(state[name].detach())

        cols = {name: state[name].shape[1] for name in names}

        def back(name: str) -> torch.Tensor:
            return int4.dequantize(held[name], held[name + SCALE], cols[name])
    else:
        raise WeightError(f"--quantization {kind!r}: fp8 or int4")
    model.rlx_quantized = (names, SCALE, back)  # the parameters computed with their held values
    model.rlx_held = {**getattr(model, "rlx_held", {}), **held}
    _dequantize_into(model, names)


def _dequantize_into(model: Any, names: set[str]) -> None:
    _, _, back = model.rlx_quantized
    params = served_state(model, held=False)  # (looked up now: moving the model replaces its tensors)
    with torch.no_grad():
        for name in names:
            params[name].copy_(back(name).to(device=params[name].device, dtype=params[name].dtype))


def move_held(model: Any, device: Any) -> None:
    """The tensors the engine holds beside its model's (quantised weights, MTP layers) to `device`, as the model is
    moved (memory release and resume)."""
    held = getattr(model, "rlx_held", {})
    for name, t in held.items():
        held[name] = t.to(device)


def load_named(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> int:
    """Copy tensors into the model's parameters and buffers by name (checkpoint names, `served_state`); all
    checked before any copy. A quantised model's weights updated (or their scales) are dequantised again
    (`serve_quantized`)."""
    state = served_state(model)
    for name, t in named:
        if name not in state:
            raise WeightError(f"unknown weight {name!r}")
        if tuple(state[name].shape) != tuple(t.shape):
            raise WeightError(f"weight {name!r}: shape {tuple(t.shape)} != model's {tuple(state[name].shape)}")
        if 1 in (state[name].dtype.itemsize, t.dtype.itemsize) and t.dtype != state[name].dtype:  # (FP8, INT4: a
            # cast without the scales would not be the weight)
            raise WeightError(f"weight {name!r}: served as {state[name].dtype}, pushed as {t.dtype}: an engine "
                              f"serves quantised weights exactly when the run's rollout.quantization says so")
    with torch.no_grad():
        for name, t in named:
            state[name].copy_(t.to(device=state[name].device, dtype=state[name].dtype))
    quantized = getattr(model, "rlx_quantized", None)
    if quantized is not None:
        names, scale, _ = quantized
        _dequantize_into(model, {n.removesuffix(scale) for n, _ in named} & names)
    return len(named)


def load_from_disk(model: torch.nn.Module, path: str) -> int:
    """Load every ``*.safetensors`` file of an HF checkpoint directory into the model."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {path}")
    named: list[tuple[str, torch.Tensor]] = []
    for f in files:
        named += list(load_file(str(f)).items())
    return load_named(model, named)


class BroadcastGroup:
    """The engine's end of the trainer→engines weight-update group (`rlx.transport.group`, SGLang's layout);
    this engine has one TP rank, so it joins as ``rank_offset``."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float = 1800, local_address: str | None = None):
        """`local_address`: the address this engine serves on; gloo binds to it (across hosts the
        default, the hostname's address, is often loopback)."""
        from rlx.transport.group import open_group

        if rank <= 0:
            raise WeightError("engine ranks start at 1 (the trainer is rank 0)")
        if backend not in ("gloo", "nccl"):
            raise WeightError(f"unknown backend {backend!r}; use gloo or nccl")
        self.name, self.rank, self.world_size = group_name, rank, world_size
        self.pg = open_group(master_address, master_port, rank, world_size, group_name, backend, timeout_s,
                             bind=local_address)
        self.device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WeightError("names, dtypes and shapes must have the same length")
        out = []
        for name, dt, shape in zip(names, dtypes, shapes, strict=True):
            if dt not in DTYPES:
                raise WeightError(f"weight {name!r}: unknown dtype {dt!r}")
            t = torch.empty(shape, dtype=DTYPES[dt], device=self.device)
            self.pg.broadcast(t, 0).wait()
            out.append((name, t))
        return out


def checksums(model: torch.nn.Module | None, names: list[str] | None, head: int | None = None,
              state: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Per-tensor hashes of the weights as served (all of them when `names` is None; of only the first
    `head` values of each when given), and every tensor's dtype (a model may keep some modules in another
    dtype than the rest). `state`: these tensors instead of the model's (a LoRA adapter's)."""
    from rlx.transport.payloads import tensor_hash

    if state is None:
        assert model is not None, "checksums of a model, or of `state`"
        state = served_state(model)
    unknown = [n for n in (names or []) if n not in state]
    if unknown:
        raise WeightError(f"unknown weight {unknown[0]!r}")

    def part(t: torch.Tensor) -> torch.Tensor:
        return t.detach().flatten()[:head] if head is not None else t

    return {"dtypes": {n: str(t.dtype).removeprefix("torch.") for n, t in state.items()},
            "checksums": {n: tensor_hash(part(state[n])) for n in (state if names is None else names)}}


# The HF architectures whose SGLang model class implements get_weights_by_name (0.5.5-0.5.23).
BY_NAME_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM",
                         "GraniteForCausalLM", "OPTForCausalLM", "Llama4ForCausalLM", "Exaone4ForCausalLM"}


def weights_by_name(model: torch.nn.Module, name: str, truncate_size: int = 100) -> list[Any]:
    """SGLang's answer: the first `truncate_size` entries along the first dimension (rows at full width for a
    matrix), as float32 values."""
    state = served_state(model)
    if name not in state:
        raise WeightError(f"unknown weight {name!r}")
    return state[name].detach().float().cpu().numpy().tolist()[:truncate_size]
