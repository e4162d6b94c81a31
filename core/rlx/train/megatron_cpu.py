"""Run megatron-core on CPU (gloo), by redirecting the few CUDA-only calls it makes.

Active only when CUDA is unavailable: `enable()` is a no-op on GPU machines, so CI and clusters run
the same Megatron code. What it redirects, and why each is safe on a CPU-only torch (where each of these
would raise "Torch not compiled with CUDA enabled"):

* ``torch.cuda.current_device()`` -> the CPU device: megatron places buffers and RoPE tables with it.
* the CUDA RNG calls megatron's model-parallel RNG tracker makes -> the CPU generator: forks for
  dropout and initialisation then draw from CPU state, one per tracker name as on GPU.
* ``Tensor.cuda()`` -> the tensor itself (megatron moves grad buffers and optimizer state with it).
* ``device="cuda"`` in tensor factories called from megatron's own modules -> CPU. Only megatron's
  modules see this: their module-level ``torch`` is swapped for a proxy, because wrapping the real
  ``torch.empty`` and friends breaks transformers' model loading (uninitialised buffers).
* ``torch.cuda.synchronize``/``empty_cache``/memory queries -> no-ops or zeros.
* ``Tensor.type()`` with no argument names CPU tensors as their CUDA types (``torch.cuda.FloatTensor``):
  megatron's optimizers choose fp32 or fp16 handling by comparing those strings.
"""

from __future__ import annotations

import sys
import types

import torch

_enabled = False
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "empty_like", "zeros_like",
              "ones_like", "full_like")
# Imported before swapping so that their module-level `torch` exists to be replaced.
_MEGATRON_MODULES = (
    "megatron.core.optimizer", "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler", "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer", "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.transformer.utils", "megatron.core.tensor_parallel.data", "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.p2p_communication",
)


def needed() -> bool:
    return not torch.cuda.is_available()


def enable() -> bool:
    """Install the redirections if CUDA is unavailable; returns whether they are active."""
    global _enabled
    if _enabled or not needed():
        return _enabled
    cpu = torch.device("cpu")
    cuda = torch.cuda
    cuda.current_device = lambda: cpu
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    original_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and ".cuda." not in name else name
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_

    import megatron.core.tensor_parallel.random as mrandom

    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *a, clone=False, **k: torch.get_rng_state()
    _proxy_megatron_torch()
    _enabled = True
    return True


def _on_cpu(device):
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda"
    ):
        return torch.device("cpu")
    return device


class _TorchOnCPU(types.ModuleType):
    """``torch`` as megatron's modules see it: the same, but factories never place tensors on CUDA."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _on_cpu(kwargs["device"])
                return value(*args, **kwargs)

            return factory
        return value


def _proxy_megatron_torch() -> None:
    import importlib

    proxy = _TorchOnCPU()
    for name in _MEGATRON_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = proxy
