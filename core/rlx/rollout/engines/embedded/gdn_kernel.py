"""The embedded engine's gated delta rule (Qwen3-Next / Qwen3.5 GDN layers): the kernel ``model.kernels.gdn``
chooses through the kernels hook (`rlx.train.kernel_choice.select`), as the trainer's does, in place of transformers'
chunked function for prefill. Decoding one token at a time keeps transformers' recurrent step.

The transformers modules are found from the model's own layers: those whose module defines a module-level
``torch_chunk_gated_delta_rule`` (which their GDN layers call). A model without one is left alone."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlx.types import HFModel


def gdn_modules(model: HFModel) -> list[Any]:  # transformers' modeling modules (patched in place)
    """The transformers modules of the model's layers that call a module-level chunked gated delta rule."""
    found = {}
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if module is not None and hasattr(module, "torch_chunk_gated_delta_rule"):
            found[module.__name__] = module
    return list(found.values())


def use_gdn_kernel(model: HFModel, choice: str = "auto") -> Callable[[], None] | None:
    """Route the model's GDN prefill through the chosen kernel; returns a function that puts transformers' back
    (None: nothing was replaced: no GDN module, or no kernel for it). A kernel named in ``model.kernels`` that
    cannot run on this engine's device (a GPU trainer's choice, CPU engines) gives way to ``auto``, saying so."""
    modules = gdn_modules(model)
    if not modules:
        return None
    from rlx.errors import RLXError
    from rlx.plugins import process_plugins
    from rlx.train.kernel_choice import candidates, select

    plugins = process_plugins()
    if not candidates(plugins, "gdn"):
        print("rlx: kernel for gdn: transformers' own (no gdn kernel plugin installed: rlx-kernel-flashqla)",
              file=sys.stderr, flush=True)
        return None
    p = next(model.parameters())
    try:
        kernel = select(plugins, "gdn", choice, where="model.kernels", device=p.device, dtype=p.dtype)
    except RLXError as e:
        if choice == "auto":
            raise
        print(f"rlx: warning: {e}; this engine uses auto", file=sys.stderr, flush=True)
        kernel = select(plugins, "gdn", "auto", where="model.kernels", device=p.device, dtype=p.dtype)

    def chunked(query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_: Any):
        return kernel(query, key, value, g, beta, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    originals = [(module, module.torch_chunk_gated_delta_rule) for module in modules]
    for module, _ in originals:
        module.torch_chunk_gated_delta_rule = chunked

    def restore() -> None:
        for module, original in originals:
            module.torch_chunk_gated_delta_rule = original

    return restore
