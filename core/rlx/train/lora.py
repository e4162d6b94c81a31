"""LoRA on the actor (``train.lora``): low-rank adapters on megatron's linear projections, everything else frozen.

Each targeted projection ``y = W x`` becomes ``y = W x + (alpha / rank) * B A dropout(x)``, with ``A`` ``[rank, in]``
and ``B`` ``[out, rank]`` in fp32 whatever the model's dtype, ``A`` drawn as peft draws it (Kaiming-uniform, from a
generator seeded by the run's seed and the projection's global name, so every layout starts from the same adapter)
and ``B`` zero, so the policy starts as the model. The optimizer holds the adapters only.

Choices:

* Adapters sit on megatron's modules, in megatron's layout, so tensor, pipeline and expert parallelism work as they
  do for the weights: a column-parallel projection keeps ``A`` whole and ``B`` split by output rows with the weight
  (its intermediate ``A x`` is copied into the tensor-parallel region, so ``A``'s gradient sums over the ranks); a
  row-parallel one splits ``A`` by input columns with the weight and keeps ``B`` whole (``A x`` is summed over the
  ranks first). An expert's projections under expert tensor parallelism leave that to the token dispatcher, as their
  weights do (`_add_adapter`). Checkpoints shard them as the weights they sit on (resuming under another layout
  works).
* Megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``: one adapter on the fused projection,
  ``A`` shared by its parts and ``B`` over their rows, which is exactly one peft adapter per part with the same
  ``A``. So targets name HF (peft) modules, and the parts of a fused projection are targeted together.
* Engines get the adapters alone (``push: adapter``, `adapters`: the model bridge lays them out as it lays out the
  weights they sit on, in peft's names) or the merged weights, ``W + (alpha / rank) B A``, through the model bridge as
  for full training (``push: merged``). ``--save-hf`` writes the merged weights and the adapters in peft's format.
* Multi-LoRA (``train.lora.adapters``): each projection holds one ``A``, ``B`` pair per adapter (``lora_A_<name>``;
  the one adapter's are ``lora_A``, ``lora_B``), all starting alike. A micro-batch holds one adapter's samples
  (`rlx.train.step.RLStep.packed`) and the forward uses that adapter's pair (`select`), so each adapter's gradient
  comes from its own samples only; one optimizer steps them all (Adam's moments are per parameter).
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from rlx.errors import RLXError

if TYPE_CHECKING:
    from rlx.config import LoRAConfig

#: megatron's projection (the end of its module name) -> the HF (peft) modules it holds, fused in that order
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "self_attention.linear_q_proj": ("q_proj",),  # latent attention without a query down-projection
    "self_attention.linear_q_down_proj": ("q_a_proj",),
    "self_attention.linear_q_up_proj": ("q_b_proj",),
    "self_attention.linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "self_attention.linear_kv_up_proj": ("kv_b_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
    "self_attention.in_proj": (),  # a gated delta net's: the model's own parts (`rlx.train.gdn.GatedDeltaNet.hf_in_proj`)
    "self_attention.out_proj": ("out_proj",),
}
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def attach(model: torch.nn.Module, cfg: LoRAConfig, seed: int, layer_offset: int, expert_offset: int
           ) -> dict[str, torch.nn.Module]:
    """Put an adapter on each targeted projection of `model`'s decoder layers and freeze everything else; returns
    the projections by module name. `layer_offset`, `expert_offset`: this rank's first decoder layer and first expert
    (global names seed the adapters)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    targets = set(cfg.target_modules)
    found: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        key = next((k for k in PROJECTIONS if name.endswith("." + k)), None)
        if key is None or not LAYER.match(name):
            continue
        parts: tuple[str, ...] = PROJECTIONS[key] or getattr(model.get_submodule(name.rpartition(".")[0]),
                                                             "hf_in_proj", ())
        if not targets & set(parts):
            continue
        if not targets >= set(parts):
            raise RLXError(f"train.lora.target_modules: {', '.join(parts)} are one fused projection in megatron "
                           f"({key}): target all of them or none")
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or getattr(module, "weight", None) is None:
            raise RLXError(f"train.lora: {name} is a {type(module).__name__}, not a megatron column- or row-parallel "
                           f"linear layer; LoRA is not built for it (leave {', '.join(parts)} out of target_modules)")
        column = isinstance(module, ColumnParallelLinear)
        if (column and module.gather_output) or (not column and not module.input_is_parallel):
            raise RLXError(f"train.lora: {name} gathers its output or splits its input itself; LoRA is not built for "
                           f"it")
        layer = int(LAYER.match(name).group(1)) + layer_offset  # type: ignore[union-attr]
        global_name = LAYER.sub(f"decoder.layers.{layer}.", name)
        expert = EXPERT.search(name)
        if expert:
            global_name = EXPERT.sub(f".local_experts.{int(expert.group(1)) + expert_offset}.", global_name)
        gated = key == "linear_fc1" and getattr(module.config, "gated_linear_unit", False)
        for adapter in cfg.names:
            _add_adapter(module, column, cfg, seed, global_name, fused_gate_up=gated, key=adapter)
        module.lora_column = column
        module.lora_parts = parts
        # (exact in fp32: `adapters` reads it back after the model bridge moved the rows or columns around)
        module.lora_key = (layer * 4096 + (int(expert.group(1)) + expert_offset + 1 if expert else 0)) * 16 + list(
            PROJECTIONS).index(key)
        found[name] = module
    if not found:
        raise RLXError(f"train.lora.target_modules: none of {sorted(targets)} is a projection of this model's decoder "
                       f"layers on this pipeline stage")
    config: Any = getattr(model, "config", None)
    if getattr(config, "moe_router_enable_expert_bias", False):
        config.moe_router_bias_update_rate = 0.0  # the aux-loss-free routing bias is the base's: frozen too
    for pname, p in model.named_parameters():
        if not pname.rpartition(".")[2].startswith(("lora_A", "lora_B")):
            p.requires_grad_(False)
    return found


def names(key: str | None) -> tuple[str, str]:
    """The parameter names of adapter `key`'s ``A`` and ``B`` (None, the one adapter: ``lora_A``, ``lora_B``;
    multi-LoRA's: ``lora_A_<name>``)."""
    end = "" if key is None else f"_{key}"
    return f"lora_A{end}", f"lora_B{end}"


def factors(module: Any, key: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapter `key`'s ``A`` and ``B`` on `module`."""
    a, b = names(key)
    return getattr(module, a), getattr(module, b)


def select(adapted: dict[str, Any], key: str | None) -> None:
    """The adapter the next forwards of the `adapted` projections use (a micro-batch's samples' `Sample.lora`)."""
    for m in adapted.values():
        if names(key)[0] not in m._parameters:
            have = sorted(k.removeprefix("lora_A_") for k in m._parameters if k.startswith("lora_A_"))
            raise RLXError(f"a sample of adapter {key!r} reached a trainer whose adapters are "
                           f"{have or 'one, unnamed (train.lora without adapters)'}")
        m.lora_active = key


def _add_adapter(module: Any, column: bool, cfg: LoRAConfig, seed: int, global_name: str, fused_gate_up: bool,
                 key: str | None) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    group = getattr(module, "tp_group", None)
    tp, rank = (group.size(), group.rank()) if group is not None else (1, 0)
    out_local, in_local = module.weight.shape
    fan_in = in_local if column else in_local * tp
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
    a = (torch.rand(cfg.rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1) / math.sqrt(fan_in)  # peft's
    if not column:
        a = a[:, rank * in_local:(rank + 1) * in_local]
    device = module.weight.device
    lora_a = torch.nn.Parameter(a.to(torch.float32).contiguous().to(device))
    lora_b = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, dtype=torch.float32, device=device))
    for name, p in zip(names(key), (lora_a, lora_b), strict=True):
        module.register_parameter(name, p)
    set_tensor_model_parallel_attributes(lora_b if column else lora_a, True, 0 if column else 1, 1)  # split as W
    for p in (lora_a, lora_b):  # experts' gradients reduce over their own data-parallel ranks
        setattr(p, "allreduce", getattr(module.weight, "allreduce", True))
    if getattr(module, "lora_scale", None) is not None:  # another adapter's: the forward and checkpoint are set
        return
    scale = cfg.alpha / cfg.rank
    # experts under expert tensor parallelism (megatron's "explicit expert communication"): the token dispatcher, not
    # the projection, gathers their input over the group and sums their row-parallel outputs, so a projection's
    # input gradient and output are partial on each rank; the branch's are left partial alike, and its whole
    # factor's gradient (computed from this rank's part) is summed over the group instead
    explicit = bool(getattr(module, "explicit_expert_comm", False))
    forward = module.forward

    def lora_forward(input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        out, bias = forward(input_, *args, **kwargs)
        if module.lora_off:  # (`AdaptersOff`: the frozen model)
            return out, bias
        x = input_.to(torch.float32)
        if cfg.dropout and torch.is_grad_enabled() and module.training:  # (log-probs without grad: no dropout)
            x = torch.nn.functional.dropout(x, cfg.dropout)
        a, b = factors(module, module.lora_active)
        if tp > 1 and explicit:  # an expert's: partial products, as the weight's
            if column:
                a = _SumGradOverGroup.apply(a, group)
            else:
                b = _SumGradOverGroup.apply(b, group)
        h = x @ a.t()
        if tp > 1 and not explicit:
            h = (copy_to_tensor_model_parallel_region if column else reduce_from_tensor_model_parallel_region)(h, group)
        return out + (scale * (h @ b.t())).to(out.dtype), bias

    module.forward = lora_forward
    module.lora_off = False
    module.lora_active = key
    sharded = module.sharded_state_dict

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = sharded(prefix, sharded_offsets, metadata)
        for k in cfg.names:
            a_name, b_name = names(k)
            lora = make_sharded_tensors_for_checkpoint(
                dict(zip((a_name, b_name), factors(module, k), strict=True)), prefix,
                {b_name: 0} if column else {a_name: 1}, sharded_offsets, tp_group=group,
                dp_cp_group=(metadata or {})["dp_cp_group"])
            if fused_gate_up and column:  # B's rows are [gate; up] on each rank, as the weight's
                lora[prefix + b_name] = apply_swiglu_sharded_factory(
                    lora[prefix + b_name], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
            out.update(lora)
        return out

    module.sharded_state_dict = sharded_state_dict
    module.lora_scale = scale


class AdaptersOff:
    """The actor with its adapters off: the frozen model it started from, which is a LoRA run's reference model
    (``kl_coef``) without a second copy of the model in memory. Computes log-probs as a role does (`schedule`)."""

    name = "reference"

    def __init__(self, actor: Any):
        self.actor = actor

    def schedule(self, batches: list, loss_fn: Any, forward_only: bool) -> list:
        assert forward_only, "the reference model is not trained"
        with adapters_off(self.actor.lora):
            return self.actor.schedule(batches, loss_fn, forward_only=True)


@contextlib.contextmanager
def adapters_off(adapted: dict[str, Any]) -> Iterator[None]:
    for m in adapted.values():
        m.lora_off = True
    try:
        yield
    finally:
        for m in adapted.values():
            m.lora_off = False


def adapter_params(model: torch.nn.Module, world: int, tp: int, dp: int, pp: int, ep: int, etp: int) -> int:
    """The adapter parameters the run trains, counted once whatever the layout (collective: every rank calls it):
    each rank's, less the copies tensor- and data-parallel ranks (experts: expert-tensor- and expert-data-parallel
    ranks) hold of them."""
    import torch.distributed as dist

    mine = 0.0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        expert = not getattr(p, "allreduce", True)
        split = getattr(p, "tensor_model_parallel", False)
        copies = (world // (pp * ep * etp) * (1 if split else etp)) if expert else (dp * (1 if split else tp))
        mine += p.numel() / copies
    total = torch.tensor([mine], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(total)
    return round(total.item())


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward, the gradient summed over `group`."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def merged(module: Any) -> torch.Tensor:
    """The projection's weight with its adapter merged in (this rank's part, the weight's dtype: in bf16 the engine's
    weight is rounded where the trainer adds the adapter's output in fp32)."""
    delta = module.lora_scale * (module.lora_B.detach() @ module.lora_A.detach())
    return (module.weight.detach().to(torch.float32) + delta).to(module.weight.dtype)


class Merged(dict):
    """A model's local state in which each adapted projection's weight reads merged (`merged`), computed when it is
    read (a push streams weights one at a time: no second copy of every adapted weight)."""

    def __init__(self, state: dict[str, torch.Tensor], adapted: dict[str, torch.nn.Module]):
        super().__init__(state)
        self.adapted = {f"{name}.weight": m for name, m in adapted.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return merged(self.adapted[name]) if name in self.adapted else super().__getitem__(name)


#: the HF projections whose adapter's A is split with the weight (row-parallel in megatron): their B is whole
ROW_PARTS = ("o_proj", "down_proj", "out_proj")


def adapters(role: Any, targets: Sequence[str], key: str | None = None
             ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Each adapted HF projection of `role`'s pipeline stage with adapter `key`'s (None: the one adapter's) peft
    ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]`` (without the scale), as peft names and lays them out for
    the transformers model: the factor
    split over ranks goes through the model bridge in the weight's place (its rows or columns moved as the weight's,
    one more row or column carrying the projection's key), the whole one comes from the rank holding it.
    Collective over the trainer's ranks: every rank calls it, and those with ``gathers`` iterate to the end (as
    `ModelRole.hf_tensors`)."""
    import torch.distributed as dist

    state = role._local_state(role.model)
    whole: dict[int, torch.Tensor] = {}
    for name, m in role.lora.items():
        a, b = (t.detach() for t in factors(m, key))
        if m.lora_column:
            state[f"{name}.weight"] = torch.cat([b, torch.full((b.shape[0], 1), float(m.lora_key), device=b.device)], 1)
            whole[m.lora_key] = a.cpu()
        else:
            state[f"{name}.weight"] = torch.cat([a, torch.full((1, a.shape[1]), float(m.lora_key), device=a.device)], 0)
            whole[m.lora_key] = b.cpu()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, whole)
    gathered = {k: v for part in everyone for k, v in part.items()}
    if not role.par.gathers:  # (a data-parallel replica of ranks that gather)
        return
    for hf_name, t in role.hf_of(state):
        module, _, kind = hf_name.rpartition(".")
        if kind != "weight" or module.rpartition(".")[2] not in targets:
            continue
        if module.endswith(ROW_PARTS):
            yield module, t[:-1].float(), gathered[int(t[-1, 0])]
        else:
            yield module, gathered[int(t[0, -1])], t[:, :-1].float()

