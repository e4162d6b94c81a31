"""The public model-bridge API: what a model plugin implements and the helpers it builds on.

A model bridge (``register_models``) claims HF ``model_type`` values and returns, from an HF config, a
`ModelSpec`: everything model-specific, so that the trainer builds whatever the spec returns and knows
no architecture (as torchtitan's TrainSpec and state-dict adapters do). A spec says

* the shape facts the rest of rlx needs (layers, vocabulary, tied embeddings, context) and the FLOPs
  model the balancer uses (`flops`);
* the megatron ``TransformerConfig`` (`transformer_config`) and the model of one pipeline stage
  (`build`; the default is megatron's GPTModel with the spec's `layer_spec`);
* HF -> megatron (`to_megatron`): this rank's tensors, read tensor by tensor (and only this rank's
  slice of each) from the checkpoint through `HFCheckpoint`, never the whole model in memory;
* megatron -> HF (`to_hf`): the stage's HF tensors one at a time, from each megatron tensor gathered
  over tensor parallelism on demand, so that HF export and weight pushes never hold two full copies;
* what engines need beside the HF folder (`engine_args`, e.g. SGLang flags a family requires).

`Stage` says which part of the model a rank holds. Helpers here (`tp_chunk`, `fuse_qkv`, `split_qkv`)
are shared by bridges; `rlx.train.decoder.DecoderSpec` is the standard decoder (GQA, dense MLP or experts)
that bridges fill or extend, and `rlx.train.moe` holds the expert mappings.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from rlx.errors import RLXError
from rlx.train.balance import FlopsModel
from rlx.types import HFConfig

if TYPE_CHECKING:
    import torch
    # megatron-core ships no types: these are Any to a type checker, and say what a value is
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rlx.config import ParallelConfig
    from rlx.plugins import Plugins

class Gather(Protocol):
    """How `ModelSpec.to_hf` reads the stage's megatron tensors (collective: every rank of the stage's
    parallel groups calls it in the same order).

    * ``gather(name)``: that tensor from every tensor-parallel rank of the stage, in rank order;
    * ``gather.experts(name)``: a local expert's tensor from every expert-parallel rank (outer list) and
      expert-tensor-parallel rank (inner list), in rank order.
    """

    def __call__(self, name: str) -> list[torch.Tensor]: ...

    def experts(self, name: str) -> list[list[torch.Tensor]]: ...


class ShardGather:
    """A `Gather` over shards held in one process: ``shards[(tp_rank, ep_rank)]`` is the state of the rank at
    that tensor- and expert-parallel position (expert-tensor-parallel rank = tensor-parallel rank). For tests
    and offline conversion."""

    def __init__(self, shards: dict[tuple[int, int], dict[str, torch.Tensor]], tp: int, ep: int = 1):
        self.shards, self.tp, self.ep = shards, tp, ep

    def __call__(self, name: str) -> list[torch.Tensor]:
        return [self.shards[(r, 0)][name] for r in range(self.tp)]

    def experts(self, name: str) -> list[list[torch.Tensor]]:
        return [[self.shards[(r, e)][name] for r in range(self.tp)] for e in range(self.ep)]


@dataclass(frozen=True)
class Stage:
    """The part of the model one rank holds: a pipeline stage's layers, and its parallel shard."""

    layer_offset: int  # global index of the stage's first layer
    num_layers: int
    first: bool  # holds the embedding
    last: bool  # holds the final norm and output layer
    tp_rank: int = 0
    tp: int = 1
    ep_rank: int = 0  # expert parallel: this rank holds experts [ep_rank * E/ep, (ep_rank + 1) * E/ep)
    ep: int = 1
    etp_rank: int = 0  # expert tensor parallel
    etp: int = 1
    mtp: int = 0  # multi-token-prediction layers built and trained here (`rlx.train.mtp`; the last stage)

    def layers(self) -> range:
        """Global indices of the stage's layers (megatron names them 0..num_layers-1 locally)."""
        return range(self.layer_offset, self.layer_offset + self.num_layers)


@dataclass(frozen=True)
class Wrapper:
    """A checkpoint whose trained part is its language model: a vision-language wrapper (Qwen3.5, Kimi-K2.5) whose
    ``text_config`` a bridge reads as a text model. `renames` are (the text model's name prefix, the checkpoint's)
    pairs, first match first (``("model.", "model.language_model.")``); a checkpoint tensor under none of the
    renamed prefixes (the vision tower, a projector) is not the language model's: the trainer neither holds nor
    pushes it, and export writes it back unchanged (`ModelSpec.carried`)."""

    renames: tuple[tuple[str, str], ...]

    def outer(self, name: str) -> str:
        """The checkpoint's name of the text model's tensor `name`."""
        for inner, outer in self.renames:
            if name.startswith(inner):
                return outer + name[len(inner):]
        return name

    def inner(self, stored: str) -> str:
        """The text model's name of the checkpoint's tensor `stored` (`outer`'s inverse)."""
        for inner, outer in self.renames:
            if stored.startswith(outer):
                return inner + stored[len(outer):]
        return stored

    def holds(self, stored: str) -> bool:
        """Whether the checkpoint's tensor `stored` is the language model's."""
        return any(stored.startswith(outer) for _, outer in self.renames)


class HFCheckpoint:
    """An HF checkpoint folder read lazily: names, shapes, one tensor, or one rank's slice of it.

    Nothing is read until asked for, and `shard` reads only the requested slice from disk
    (safetensors' ``get_slice``), so a rank holding 1/tp of a layer reads about 1/tp of its bytes.
    """

    def __init__(self, folder: str | Path, wrapper: Wrapper | None = None):
        """`wrapper`: the checkpoint wraps the language model the bridge reads (`Wrapper`); names asked for are the
        language model's, `names` lists the checkpoint's."""
        from safetensors import safe_open

        from rlx.models.fp8 import block_size

        self.folder, self.wrapper = Path(folder), wrapper
        self.fp8_block = block_size(self.folder)  # FP8 weights are read dequantised (`rlx.models.fp8`)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise RLXError(f"model.path: no *.safetensors in {self.folder}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, Any] = {}
        for h in self._handles:
            for name in h.keys():
                self._where[name] = h
        self.bytes_read = 0  # what `get` and `shard` read so far (for memory tests)

    def names(self) -> list[str]:
        return list(self._where)

    def _stored(self, name: str) -> str:
        return self.wrapper.outer(name) if self.wrapper is not None else name

    def __contains__(self, name: str) -> bool:
        return self._stored(name) in self._where

    def _handle(self, name: str) -> tuple[Any, str]:
        stored = self._stored(name)
        try:
            return self._where[stored], stored
        except KeyError:
            raise RLXError(f"model.path: the checkpoint in {self.folder} has no tensor {stored!r}") from None

    def shape(self, name: str) -> list[int]:
        h, stored = self._handle(name)
        return list(h.get_slice(stored).get_shape())

    def get(self, name: str) -> torch.Tensor:
        h, stored = self._handle(name)
        t = h.get_tensor(stored)
        self.bytes_read += t.numel() * t.element_size()
        return self._dequantized(stored, t)

    def stored(self, name: str) -> torch.Tensor:
        """The tensor as the checkpoint stores it (FP8 weights quantised)."""
        h, stored = self._handle(name)
        return h.get_tensor(stored)

    def _dequantized(self, stored: str, t: torch.Tensor, rows: range | None = None,
                     cols: range | None = None) -> torch.Tensor:
        from rlx.models.fp8 import SCALE, dequantize, is_fp8

        if not is_fp8(t) or self.fp8_block is None or stored + SCALE not in self._where:
            return t
        return dequantize(t, self._where[stored + SCALE].get_tensor(stored + SCALE), self.fp8_block, rows, cols)

    def shard(self, name: str, dim: int, rank: int, parts: int) -> torch.Tensor:
        """Chunk `rank` of `parts` equal chunks along `dim`, reading only that chunk."""
        if parts == 1:
            return self.get(name)
        h, stored = self._handle(name)
        sl = h.get_slice(stored)
        size = sl.get_shape()[dim]
        if size % parts:
            raise RLXError(f"{name}: dimension {dim} ({size}) does not split into {parts} parallel parts")
        n = size // parts
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(rank * n, (rank + 1) * n)
        t = sl[tuple(index)]
        self.bytes_read += t.numel() * t.element_size()
        span = range(rank * n, (rank + 1) * n)
        return self._dequantized(stored, t, *((span, None) if dim == 0 else (None, span)))


@runtime_checkable
class ModelBridge(Protocol):
    """The ``models`` component kind: claims HF ``model_type`` values and describes how to build and convert
    such a model (its `ModelSpec`). Registration checks it as `rlx.protocols` checks every kind."""

    name: str

    @property
    def model_types(self) -> tuple[str, ...]:  # the HF ``model_type`` values it claims (a class attribute)
        ...

    def spec(self, hf_config: HFConfig) -> ModelSpec: ...


@dataclass
class ModelSpec(ABC):
    """What the trainer needs to build and convert one model. Bridges subclass it and fill the methods.

    The defaults cover megatron's GPTModel with rotary embeddings; a bridge overrides `build` for
    anything else.
    """

    model_type: str
    hf_config: HFConfig = field(repr=False)
    num_layers: int
    vocab_size: int
    hidden_size: int
    max_positions: int
    tied: bool
    flops: FlopsModel
    rope_theta: float = 10000.0
    rotary_percent: float = 1.0  # the share of each head's dimensions that rotary embedding rotates (rotate-half)
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)
    wrapper: Wrapper | None = None  # the checkpoint wraps the language model this spec trains
    # the run's kernel choices (``model.kernels``: op -> kernel name or "auto") and its plugins, which
    # `kernel` selects from; set by `model_spec`
    kernel_choices: dict[str, str] = field(default_factory=dict, repr=False)
    plugins: Plugins | None = field(default=None, repr=False)

    # -- megatron side ---------------------------------------------------------------------------

    @abstractmethod
    def transformer_config(self, parallel: ParallelConfig, dtype: torch.dtype, **common: Any) -> TransformerConfig:
        """megatron's TransformerConfig for `parallel` (a ParallelConfig). `common` holds what the
        trainer needs set on every model (loss per token, variable sequence lengths...)."""

    @abstractmethod
    def layer_spec(self, config: TransformerConfig, stage: Stage) -> ModuleSpec:
        """megatron's ModuleSpec of a transformer layer (local, non Transformer Engine, on CPU)."""

    def build(self, config: TransformerConfig, stage: Stage) -> torch.nn.Module:
        """The megatron model of one pipeline stage, with uninitialised-but-allocated weights (and the trained
        multi-token-prediction layers, `Stage.mtp`, as ``model.mtp``)."""
        from megatron.core.models.gpt import GPTModel

        from rlx.train.mtp import attach

        model = GPTModel(config, self.layer_spec(config, stage), vocab_size=self.vocab_size,
                         max_sequence_length=self.max_positions, position_embedding_type="rope",
                         rotary_base=self.rope_theta, rotary_percent=self.rotary_percent,
                         share_embeddings_and_output_weights=self.tied,
                         pre_process=stage.first, post_process=stage.last)
        if stage.mtp:
            attach(model, config, self.mtp_layer_spec(config, stage), stage.mtp)
        return model

    @property
    def mtp_layers(self) -> int:
        """The multi-token-prediction layers the checkpoint stores after its last layer (``num_nextn_predict_layers``:
        DeepSeek-V3/V3.2, Kimi-K2, GLM-4.5 and later)."""
        text = self.hf_config.get_text_config() if hasattr(self.hf_config, "get_text_config") else self.hf_config
        return int(getattr(text, "num_nextn_predict_layers", 0) or 0)

    def mtp_layer_spec(self, config: TransformerConfig, stage: Stage) -> ModuleSpec:
        """megatron's ModuleSpec of the decoder layer inside a multi-token-prediction layer, for families that train
        them (`DecoderSpec`); the HF conversions of `Stage.mtp` layers come with it."""
        raise RLXError(f"train.objective.mtp_loss_coef: rlx does not train the multi-token-prediction layers of "
                       f"{self.model_type!r} models; leave it at 0 (they are written back unchanged)")

    # -- weights ---------------------------------------------------------------------------------

    @abstractmethod
    def to_megatron(self, ckpt: HFCheckpoint, stage: Stage) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's megatron tensors (local names), one at a time, read from the HF checkpoint."""

    @abstractmethod
    def to_hf(self, stage: Stage, gather: Gather) -> Iterator[tuple[str, torch.Tensor]]:
        """The stage's full HF tensors, one at a time. Every tensor-parallel rank of the stage runs it
        (`gather` is collective); only what tensor-parallel rank 0 yields is used."""

    # -- the checkpoint's names ---------------------------------------------------------------------

    def read(self, folder: str | Path) -> HFCheckpoint:
        """The HF checkpoint at `folder` as `to_megatron` reads it (the language model's names, when wrapped)."""
        return HFCheckpoint(folder, self.wrapper)

    def hf_tensors(self, stage: Stage, gather: Gather) -> Iterator[tuple[str, torch.Tensor]]:
        """`to_hf` under the checkpoint's names: what export writes and weight pushes send."""
        if self.wrapper is None:
            yield from self.to_hf(stage, gather)
            return
        for name, t in self.to_hf(stage, gather):
            yield self.wrapper.outer(name), t

    def carried(self, names: list[str]) -> list[str]:
        """The checkpoint's tensors (of `names`) the trainer does not hold, which export writes back unchanged: a
        wrapper's vision tower and projector, and the multi-token-prediction layers: stored after the last layer
        (``model.layers.{num_layers + k}``, DeepSeek's and GLM's) while they are not trained, and Qwen3-Next's and
        Qwen3.5's (``mtp.*``)."""
        import re

        mtp = re.compile(r"model\.layers\.(\d+)\.")
        out = []
        for name in names:
            if (self.wrapper is not None and not self.wrapper.holds(name)) or name.startswith("mtp."):
                out.append(name)
                continue
            m = mtp.match(self.wrapper.inner(name) if self.wrapper is not None else name)
            if m and int(m.group(1)) >= self.num_layers:
                out.append(name)
        return out

    def engine_args(self) -> dict[str, Any]:
        """SGLang server arguments this model family needs (``{}`` for most)."""
        return {}

    def kernel(self, op: str, **query: Any) -> Any:
        """The kernel for `op` that ``model.kernels`` chooses (``auto`` if it names none) and that can run `query`
        (device, dtype...): `rlx.train.kernel_choice.select` over the run's plugins (the installed ones when the spec
        was made without them)."""
        from rlx.plugins import process_plugins
        from rlx.train.kernel_choice import select

        if self.plugins is None:
            self.plugins = process_plugins()
        return select(self.plugins, op, self.kernel_choices.get(op, "auto"), where="model.kernels", **query)


# -- helpers bridges share -------------------------------------------------------------------------


def tp_chunk(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """Chunk `rank` of `parts` along `dim` (a copy, so it owns its storage)."""
    return t.chunk(parts, dim=dim)[rank].clone() if parts > 1 else t


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int,
             head_dim: int) -> torch.Tensor:
    """megatron's fused ``linear_qkv`` layout from separate q, k and v (weights or biases): per query
    group, ``[its q heads, k, v]``. Tensor parallelism splits it by query groups (dim 0)."""
    import torch

    per = heads // kv_heads
    q = q.reshape(kv_heads, per * head_dim, *q.shape[1:])
    k = k.reshape(kv_heads, head_dim, *k.shape[1:])
    v = v.reshape(kv_heads, head_dim, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def split_qkv(fused: torch.Tensor, heads: int, kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_qkv` on the full (tensor-parallel gathered) tensor."""
    per = heads // kv_heads
    g = fused.reshape(kv_heads, (per + 2) * head_dim, *fused.shape[1:])
    q, k, v = g.split([per * head_dim, head_dim, head_dim], dim=1)
    rest = fused.shape[1:]
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


def rope_theta(hf_config: HFConfig, default: float = 10000.0) -> float:
    """RoPE base, wherever the transformers version keeps it."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return float(theta or getattr(hf_config, "rope_theta", None) or default)


S = TypeVar("S", bound=ModelSpec)


def wrapped(spec: S, hf_config: HFConfig, renames: tuple[tuple[str, str], ...]) -> S:
    """`spec` (of the wrapper's ``text_config``) as the spec of the wrapper checkpoint `hf_config`, whose names
    `renames` gives (`Wrapper`); its tied embeddings as the wrapper says, as transformers ties them."""
    spec.hf_config, spec.model_type = hf_config, hf_config.model_type
    spec.tied = bool(getattr(hf_config, "tie_word_embeddings", spec.tied))
    spec.wrapper = Wrapper(renames)
    return spec


def model_spec(model_path: str | Path, plugins: Plugins, kernels: dict[str, str] | None = None) -> ModelSpec:
    """The spec of the HF checkpoint at `model_path`, from the bridge that claims its ``model_type``, choosing
    kernels as `kernels` (``model.kernels``) says."""
    from rlx.models.load import load_config

    bridge = plugins.bridge_for(read_model_type(model_path))
    spec = bridge.spec(load_config(model_path))
    if not isinstance(spec, ModelSpec):
        raise RLXError(f"model bridge {bridge.name!r} returned {type(spec).__name__} from spec(); "
                       f"the contract is an rlx.train.spec.ModelSpec")
    spec.kernel_choices, spec.plugins = dict(kernels or {}), plugins
    return spec


def read_model_type(folder: str | Path) -> str:
    """The ``model_type`` of an HF checkpoint folder (from config.json), without importing transformers."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())["model_type"]
    except (OSError, ValueError, KeyError) as e:
        raise RLXError(f"model.path: cannot read model_type from {path}: {e}") from None
