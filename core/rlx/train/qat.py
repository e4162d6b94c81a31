"""Quantisation-aware training for INT4 rollout (``train.qat: int4``): the policy's forward computes with each
quantised weight as an INT4 engine serves it (`rlx.models.int4.fake_quantize`: the same groups of 128 input columns
per row, the same scales), and its gradient passes straight through to the weight the optimizer holds (the
straight-through estimator), so that the policy trained is the policy sampled. The trainer's log-probs are then the
engine's (``train_rollout_logprob_diff`` as in full precision) instead of those of the weights before quantisation.

The weights quantised are the decoder layers' linear projections that `rlx.models.fp8.QUANTISED` names on the HF
side, under megatron's names: attention's fused ``linear_qkv`` (or latent attention's query and key/value-up
projections) and ``linear_proj``, the MLPs' ``linear_fc1`` and ``linear_fc2`` (experts' and shared experts'
included). Megatron fuses q/k/v and gate/up by rows, so groups along the input columns are the HF weights' groups.
Row-parallel weights are split by input columns: each tensor-parallel rank's part must hold whole groups. Not
quantised here: trained multi-token-prediction layers (the engine's drafts), whose weights the engine holds in INT4.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from rlx.errors import RLXError

#: megatron's modules whose HF weights `rlx.models.fp8.QUANTISED` names (not latent attention's ``linear_kv_down_proj``,
#: whose HF ``kv_a_proj_with_mqa`` it does not)
QUANTISED = re.compile(r"^decoder\.layers\.\d+\.(self_attention\.(linear_qkv|linear_proj|linear_q_proj|linear_q_down_proj"
                       r"|linear_q_up_proj|linear_kv_up_proj)|mlp(\.experts\.local_experts\.\d+|\.shared_experts)?"
                       r"\.(linear_fc1|linear_fc2))$")


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        from rlx.models.int4 import fake_quantize

        return fake_quantize(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def fake_quantize_linears(model: torch.nn.Module) -> int:
    """Make every `QUANTISED` linear layer of `model` compute with its weight fake-quantised; returns how many."""
    from megatron.core.tensor_parallel import RowParallelLinear

    from rlx.models.int4 import GROUP
    from rlx.train.gdn import GatedDeltaNet

    if any(isinstance(m, GatedDeltaNet) for m in model.modules()):
        raise RLXError("train.qat: not built for gated delta net layers (Qwen3-Next, Qwen3.5): their projections "
                       "would be quantised on the engine's side only")
    count = 0
    for name, module in model.named_modules():
        if not QUANTISED.match(name):
            continue
        local, whole = module.weight.shape[1], getattr(module, "input_size", module.weight.shape[1])
        if isinstance(module, RowParallelLinear) and local != whole and local % GROUP:
            raise RLXError(f"train.qat: {name} splits its {whole} input columns over parallel ranks into parts of "
                           f"{local}, so INT4 groups of {GROUP} would straddle the ranks; choose tp (etp for experts) "
                           f"that leaves each rank whole groups")
        _wrap(module)
        count += 1
    if not count:
        raise RLXError("train.qat: none of the model's layers is one rlx quantises (rlx.train.qat.QUANTISED)")
    return count


def _wrap(module: torch.nn.Module) -> None:
    forward = module.forward

    def quantised_forward(*args: Any, **kwargs: Any) -> Any:
        weight = module._parameters["weight"]
        module._parameters["weight"] = _FakeQuantize.apply(weight)  # (a tensor in the parameter's place)
        try:
            return forward(*args, **kwargs)
        finally:
            module._parameters["weight"] = weight

    module.forward = quantised_forward  # type: ignore[method-assign]
