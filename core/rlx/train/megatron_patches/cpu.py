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

For mixture-of-experts and latent attention (each its own function, with a test that fails without it):

* `stub_cuda_streams`: ``torch.cuda.Stream``/``Event``/``current_stream``/``stream`` and
  ``Tensor.record_stream`` as no-ops: the alltoall token dispatcher makes a stream when it is built and
  synchronises on the current one in every forward.
* `fix_router_gemm`: megatron-core 0.16.1 binds ``moe_utils.te_general_gemm`` only when Transformer Engine
  imports, but every router forward reads it (a NameError without TE).
* `list_split_sizes`: on CPU the dispatcher's all-to-all split sizes stay tensors (it converts only CUDA
  tensors), and ``all_to_all_single`` takes only sequences of ints (expert parallelism over gloo).
* `no_te_in_mla`: multi-latent attention believes TE is there (its stand-ins are MagicMocks) and calls
  ``isinstance`` with them. MLA's core attention is `rlx.train.attention.SDPACoreAttention`: megatron's
  local one does not take ``k_channels``/``v_channels``.
* `no_compile`: megatron's ``jit_fuser`` is ``torch.compile``; its first call on CPU takes tens of seconds. It is
  made a no-op as megatron is imported (`rlx.train.megatron_patches.jit`, installed by ``import rlx.train``), which also spares each
  trainer process the 1.3 s import of torch's compiler.
* `uneven_gathers`: with expert and expert-tensor parallelism together, the token dispatcher all-gathers and
  reduce-scatters pieces of different lengths over the expert-tensor-parallel group; gloo takes only equal
  pieces. Uneven pieces are padded to the longest for the all-gather, and the reduce-scatter becomes an
  all-reduce of which each rank keeps its piece.
"""

from __future__ import annotations

import sys
import types
from typing import Any

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
    cuda: Any = torch.cuda  # Any: its functions are replaced in place, which torch's types do not allow
    tensor: Any = torch.Tensor  # the same
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
    tensor.cuda = lambda self, *a, **k: self
    original_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and ".cuda." not in name else name
        return original_type(self, dtype, non_blocking, **kwargs)

    tensor.type = type_

    import megatron.core.tensor_parallel.random as mrandom

    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *a, clone=False, **k: torch.get_rng_state()
    _proxy_megatron_torch()
    for fix in (stub_cuda_streams, fix_router_gemm, list_split_sizes, no_te_in_mla, no_compile, uneven_gathers):
        fix()
    _enabled = True
    return True


class _Event:
    def __init__(self, *a, **k) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    def __init__(self, *a, **k) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


_STREAM = _Stream()


def stub_cuda_streams() -> None:
    import contextlib

    cuda: Any = torch.cuda  # Any: its classes and functions are replaced in place, which torch's types do not allow
    cuda.Stream, cuda.Event = _Stream, _Event
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _STREAM
    cuda.stream = lambda s=None: contextlib.nullcontext(s)
    tensor: Any = torch.Tensor  # the same
    tensor.record_stream = lambda self, stream=None: None


def fix_router_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _int_list(x):
    if x is None or isinstance(x, list):
        return x
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


def list_split_sizes() -> None:
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings._AllToAll, "_rlx_int_lists", False):
        return
    forward = mappings._AllToAll.forward

    def with_lists(ctx, group, input, output_split_sizes, input_split_sizes):
        return forward(ctx, group, input, _int_list(output_split_sizes), _int_list(input_split_sizes))

    mappings._AllToAll.forward = staticmethod(with_lists)  # backward reuses the (now list) sizes kept in ctx
    mappings._AllToAll._rlx_int_lists = True


def no_te_in_mla() -> None:
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def no_compile() -> None:
    """Megatron imported before rlx (or compiled functions called): its fused functions are ``torch.compile``d
    ones, which dynamo must not compile on CPU."""
    from megatron.core import jit

    if jit.jit_fuser is not jit.noop_decorator or "torch._dynamo" in sys.modules:
        import torch._dynamo

        torch._dynamo.config.disable = True


def uneven_gathers() -> None:
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings, "_rlx_uneven", False):
        return
    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = _int_list(output_split_sizes)
        if sizes is None or group.size() == 1 or len(set(sizes)) == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)], 0)

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        sizes = _int_list(input_split_sizes)
        if sizes is None or group.size() == 1 or len(set(sizes)) == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone().contiguous()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start:start + sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven
    mappings._rlx_uneven = True


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
    # a copy taken at once: list(sys.modules.items()) runs Python (a garbage collection) as it goes, and another
    # thread importing meanwhile (the engines starting beside the trainer) stopped a run with "dictionary changed
    # size during iteration"
    for name, module in sys.modules.copy().items():
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            setattr(module, "torch", proxy)  # an attribute a module's type does not declare
