"""rlx kernel plugin for the gated delta rule (``op = "gdn"``), the recurrence of the gated delta net layers of
Qwen3-Next and Qwen3.5, selected by model bridges through `rlx.train.kernel_choice.select` (``model.kernels: {gdn:
flashqla}``, ``fla``, ``torch`` or ``auto``):

* ``gdn-flashqla`` (preferred): FlashQLA's chunked kernels, on GPUs of compute capability 9.0, 10.0, 10.3, 12.0 or
  12.1 (the ones FlashQLA 0.1.3 builds for), bf16 or fp16. FlashQLA imports tilelang and raises at import without
  such a GPU, so `supports` decides from the device, the dtype and whether the packages are installed, before
  anything is imported.
* ``gdn-fla``: flash-linear-attention's Triton kernels, on any CUDA device, when installed.
* ``gdn-torch``: `rlx_kernel_flashqla.torch_gdn`, chunked, in plain torch: CPU or GPU, any dtype (computed in
  fp32), forward and backward, packed sequences. Always available: the CPU install pulls neither Triton nor
  tilelang (``pip install 'rlx-kernel-flashqla[gpu]'`` adds FlashQLA and fla).

All three take flash-linear-attention's arguments: ``(q, k, v, g, beta, scale=None, initial_state=None,
output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False)`` with q, k ``[B, T, H, K]``,
v ``[B, T, HV, V]``, g and beta ``[B, T, HV]``, and return ``(o [B, T, HV, V], final_state [N, HV, K, V] | None)``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rlx import hookimpl
from rlx.hookspecs import RegisterKernels

FLASHQLA_CAPABILITIES = {(9, 0), (10, 0), (10, 3), (12, 0), (12, 1)}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cuda_reason(device: Any) -> str | None:
    import torch

    if device is None or torch.device(device).type != "cuda":
        return f"it runs on CUDA devices, the model is on {device or 'the CPU'}"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


class TorchGDN:
    name = "gdn-torch"
    op = "gdn"
    priority = 0

    def supports(self, **query: Any) -> str | None:
        return None

    def __call__(self, q, k, v, g, beta, **kwargs: Any):
        from rlx_kernel_flashqla.torch_gdn import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)


class FlaGDN:
    name = "gdn-fla"
    op = "gdn"
    priority = 10

    def supports(self, device: Any = None, **query: Any) -> str | None:
        if not _installed("fla"):
            return "flash-linear-attention is not installed (pip install 'rlx-kernel-flashqla[gpu]')"
        return _cuda_reason(device)

    def __call__(self, q, k, v, g, beta, **kwargs: Any):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)


class FlashQLAGDN:
    name = "gdn-flashqla"
    op = "gdn"
    priority = 20

    def supports(self, device: Any = None, dtype: Any = None, **query: Any) -> str | None:
        import torch

        if not (_installed("flash_qla") and _installed("tilelang")):
            return "FlashQLA (flash-qla, with tilelang) is not installed (pip install 'rlx-kernel-flashqla[gpu]')"
        reason = _cuda_reason(device)
        if reason is not None:
            return reason
        capability = torch.cuda.get_device_capability(torch.device(device))
        if capability not in FLASHQLA_CAPABILITIES:
            return (f"FlashQLA builds for compute capability 9.0, 10.0, 10.3, 12.0 and 12.1; this GPU is "
                    f"{capability[0]}.{capability[1]}")
        if dtype not in (torch.bfloat16, torch.float16):
            return f"FlashQLA runs bf16 or fp16, the model is {dtype}"
        return None

    def __call__(self, q, k, v, g, beta, **kwargs: Any):
        from flash_qla import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)


@hookimpl
def register_kernels(register: RegisterKernels) -> None:
    register(FlashQLAGDN)
    register(FlaGDN)
    register(TorchGDN)
