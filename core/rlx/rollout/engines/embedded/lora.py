"""LoRA adapters served beside the model, as SGLang serves them with ``--enable-lora``: loaded and unloaded by name
while the engine runs (from a peft folder or from tensors), and named per request (``lora_path``), so that one batch
mixes requests of several adapters and of the base model.

peft does the serving: its LoRA layers are injected into the transformers model (``inject_adapter_in_model``, one
adapter name per load, on exactly the modules the adapter has tensors for), and every forward passes each row's adapter
(``adapter_names``, ``"__base__"`` for none) to them through a pre-forward hook, which is peft's own mixed-batch path.
Every batch takes that path, whatever adapters its rows name: peft's plain path (one active adapter) rounds the
adapter's output otherwise in bf16, and was no faster here (`benchmarks/lora.py`). The adapters are held in fp32 and
their branch computed in fp32, then added in the model's dtype, as rlx's trainer does.

Everything here runs in the scheduler's thread, except reading which adapters are loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlx.transport.payloads import WireError

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch
PREFIX = "base_model.model."  # peft's tensor names: base_model.model.<module>.lora_A.weight


class AdapterError(WireError):
    """An adapter that cannot be loaded or unloaded (the message is the engine's answer)."""


class Adapters:
    def __init__(self, model: torch.nn.Module, max_rank: int | None = None, targets: list[str] | None = None):
        """`max_rank`, `targets`: SGLang's ``--max-lora-rank`` and ``--lora-target-modules`` (``all``: any); an adapter
        past them is refused, as SGLang refuses it."""
        self.model = model
        self.max_rank = max_rank
        self.targets = None if targets is None or "all" in targets else set(targets)
        self.loaded: dict[str, str] = {}  # name -> where it came from (a folder, or "__tensor__"), as SGLang lists it
        self.users: Counter[str] = Counter()  # requests admitted and not finished, per adapter
        self.closing: dict[str, list[Callable[[], None]]] = {}  # unloads waiting for their requests to finish
        self.rows: list[str] | None = None  # each row's adapter in the forward under way
        self.hooked: set[int] = set()
        # checkpoint module names -> the model's, where transformers renamed them on load (`weights.name_as_checkpoint`)
        renamed: dict[str, str] = getattr(model, "rlx_checkpoint_names", {})
        self.module_of = {c.removesuffix(".weight"): m.removesuffix(".weight") for m, c in renamed.items()
                          if m.endswith(".weight") and c.endswith(".weight")}

    # -- loading -----------------------------------------------------------------------------------

    def load(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], source: str) -> None:
        """Serve the peft adapter `tensors` (peft's names) with `config` (its ``adapter_config``) as `name`."""
        from peft import LoraConfig, inject_adapter_in_model

        if name in self.loaded or name in self.closing:
            raise AdapterError(f"The LoRA adapter {name} is already loaded" if name in self.loaded else
                               f"LoRA adapter '{name}' has an incomplete unload. Retry the unload before loading it "
                               f"again.")
        rank = config.get("r")
        if self.max_rank is not None and isinstance(rank, int) and rank > self.max_rank:
            raise AdapterError(f"LoRA adapter {name} with rank {rank} exceeds max_lora_rank={self.max_rank}")
        modules: dict[str, str] = {}  # the model's module -> the adapter's (checkpoint) name for it
        for key in tensors:
            if not (key.startswith(PREFIX) and key.endswith((".lora_A.weight", ".lora_B.weight"))):
                raise AdapterError(f"LoRA adapter {name}: {key!r} is not a peft LoRA tensor name "
                                   f"({PREFIX}<module>.lora_A.weight or lora_B)")
            module = key[len(PREFIX):].rsplit(".", 2)[0]
            modules[self.module_of.get(module, module)] = module
        kinds = {m.rsplit(".", 1)[-1] for m in modules.values()}
        if self.targets is not None and not kinds <= self.targets:
            raise AdapterError(f"LoRA adapter {name} targets {sorted(kinds - self.targets)}, which are not in "
                               f"--lora-target-modules {sorted(self.targets)}")
        fields = {f.name for f in dataclasses.fields(LoraConfig)}
        options = {k: v for k, v in config.items() if k in fields and k not in ("target_modules", "peft_type")}
        # (no dropout when serving: peft's new dropout modules would be in training mode)
        peft_config = LoraConfig(**{**options, "target_modules": sorted(modules), "inference_mode": True,
                                    "lora_dropout": 0.0})
        try:
            inject_adapter_in_model(peft_config, self.model, adapter_name=name)
            for module_name, module in self._layers():
                if name not in module.lora_A:
                    continue
                ckpt = modules.get(module_name)
                if ckpt is None:
                    raise AdapterError(f"LoRA adapter {name}: peft put an adapter on {module_name}, which has no "
                                       f"tensors")
                for part in ("lora_A", "lora_B"):
                    key = f"{PREFIX}{ckpt}.{part}.weight"
                    if key not in tensors:
                        raise AdapterError(f"LoRA adapter {name}: no tensor {key}")
                    layer = getattr(module, part)[name].to(torch.float32)  # (in place)
                    if layer.weight.shape != tensors[key].shape:
                        raise AdapterError(f"LoRA adapter {name}: {key} is {list(tensors[key].shape)}, the model's "
                                           f"is {list(layer.weight.shape)}")
                    with torch.no_grad():
                        layer.weight.copy_(tensors[key])
                if id(module) not in self.hooked:
                    module.register_forward_pre_hook(self._hook, with_kwargs=True)
                    self.hooked.add(id(module))
        except Exception as e:
            self._delete(name)
            if isinstance(e, AdapterError):
                raise
            raise AdapterError(f"LoRA adapter {name}: {type(e).__name__}: {e}") from None
        self.loaded[name] = source

    def unload(self, name: str, done: Callable[[], None]) -> None:
        """Stop new requests from naming `name`, and delete it once those that do finished; then call `done`."""
        if name not in self.loaded:
            raise AdapterError(f"LoRA adapter {name} is not loaded")
        del self.loaded[name]
        self.closing.setdefault(name, []).append(done)
        self._close(name)

    def hold(self, name: str | None) -> bool:
        """A request naming `name` is admitted (False: that adapter is not loaded)."""
        if name is None:
            return True
        if name not in self.loaded:
            return False
        self.users[name] += 1
        return True

    def release(self, name: str) -> None:
        """A request `hold` admitted finished."""
        self.users[name] -= 1
        self._close(name)

    def _close(self, name: str) -> None:
        if name in self.closing and self.users[name] <= 0:
            self._delete(name)
            del self.users[name]
            for done in self.closing.pop(name):
                done()

    def _delete(self, name: str) -> None:
        for _, module in self._layers():
            if name in module.lora_A:
                module.delete_adapter(name)
        getattr(self.model, "peft_config", {}).pop(name, None)  # (what inject_adapter_in_model records)

    def _layers(self) -> Iterator[tuple[str, Any]]:
        from peft.tuners.lora import LoraLayer

        for module_name, module in self.model.named_modules():
            if isinstance(module, LoraLayer):
                yield module_name, module

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors as loaded, by peft's names."""
        inverse = {m: c for c, m in self.module_of.items()}
        return {f"{PREFIX}{inverse.get(m, m)}.{part}.weight": getattr(module, part)[name].weight
                for m, module in self._layers() if name in module.lora_A for part in ("lora_A", "lora_B")}

    # -- serving -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def serving(self, rows: list[str | None]) -> Iterator[None]:
        """A forward of rows generated with these adapters (None: the base model)."""
        self.rows = [BASE if r is None else r for r in rows] if self.hooked else None
        try:
            yield
        finally:
            self.rows = None

    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
        # every LoRA layer runs peft's mixed-batch path, so that no adapter applies to rows that do not name it
        kwargs["adapter_names"] = self.rows if self.rows is not None else [BASE] * args[0].shape[0]
        return args, kwargs
