"""The embedded engine's gated delta rule (Qwen3-Next / Qwen3.5 GDN layers): the kernel ``model.kernels.gdn``
chooses through the kernels hook (`rlx.train.kernels.select`), as the trainer's does, in place of transformers'
chunked function for prefill. Decoding one token at a time keeps transformers' recurrent step."""

from __future__ import annotations

import sys
from typing import Any

# transformers modules whose GDN layers call a module-level ``torch_chunk_gated_delta_rule``
GDN_MODULES = ("transformers.models.qwen3_next.modeling_qwen3_next", "transformers.models.qwen3_5.modeling_qwen3_5",
               "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def use_gdn_kernel(model: Any, choice: str = "auto") -> str | None:
    """Route the model's GDN prefill through the chosen kernel; returns its name (None: the model has no GDN
    layers)."""
    if "linear_attention" not in (getattr(model.config, "layer_types", None) or []):
        return None
    from rlx.plugins import build_plugins
    from rlx.train.kernels import select

    p = next(model.parameters())
    kernel = select(build_plugins(), "gdn", choice, where="model.kernels", device=p.device, dtype=p.dtype)

    def chunked(query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_: Any):
        return kernel(query, key, value, g, beta, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    patched = 0
    for name in GDN_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "torch_chunk_gated_delta_rule"):
            module.torch_chunk_gated_delta_rule = chunked
            patched += 1
    if not patched:
        raise RuntimeError(f"{model.config.model_type}: no transformers GDN module to give the {kernel.name} kernel "
                           f"(looked in {', '.join(GDN_MODULES)})")
    return kernel.name
