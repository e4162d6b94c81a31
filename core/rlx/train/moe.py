"""Mixture-of-experts pieces bridges share: the experts' shape and megatron settings (`MoEShape`), and the
weight mappings of routers, routed experts and gated MLPs (dense or shared experts).

HF checkpoints store routed experts one tensor per expert and projection (transformers 5 fuses them in
memory but ``save_pretrained`` writes ``experts.{e}.{gate,up,down}_proj.weight``); megatron's SequentialMLP
holds expert-parallel rank r's experts ``[r*E/ep, (r+1)*E/ep)`` as ``experts.local_experts.{j}`` with
``linear_fc1 = [gate; up]`` and ``linear_fc2 = down``, each split over expert-tensor-parallel ranks like a
dense MLP. ``gather.experts(name)`` (see `rlx.train.spec.Gather`) returns a local expert tensor from every
expert-parallel rank (outer) and expert-tensor-parallel rank (inner), so `experts_to_hf` can name each by
its global index.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal


if TYPE_CHECKING:
    import torch
    from megatron.core.transformer.moe.router import TopKRouter  # untyped: Any to the checker, named here
    from torch.distributed import ProcessGroup

    from rlx.config import ParallelConfig
    from rlx.train.packing import PackedBatch
    from rlx.train.spec import Gather, HFCheckpoint, Stage
    from rlx.types import HFConfig
    from rlx.types import Sample


@dataclass(frozen=True)
class MoEShape:
    """A model's experts and how its router picks them (the megatron settings of the family)."""

    experts: int  # routed experts per MoE layer
    topk: int  # experts per token
    ffn: int  # width of one routed expert
    layers: frozenset[int]  # global indices of the MoE layers (the others are dense)
    shared_ffn: int = 0  # width of the shared experts (0: none)
    shared_gate: bool = False  # the shared experts' output times sigmoid(a learned [1, hidden] projection)
    score: Literal["softmax", "sigmoid"] = "softmax"
    pre_softmax: bool = False  # softmax over all experts before top-k (no renormalisation of the k)
    expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias added for selection only
    bias_update_rate: float = 1e-3
    groups: int | None = None  # grouped top-k: experts in `groups` groups, the best `group_topk` groups
    group_topk: int | None = None
    scaling: float | None = None  # routed weights multiplied by this
    aux_loss_coeff: float = 0.0  # load-balancing loss in the training loss (0: off)

    def transformer_kwargs(self, num_layers: int, parallel: ParallelConfig) -> dict[str, Any]:
        """megatron ``TransformerConfig`` arguments for these experts under `parallel` (a ParallelConfig)."""
        kw: dict[str, Any] = dict(
            num_moe_experts=self.experts, moe_router_topk=self.topk, moe_ffn_hidden_size=self.ffn,
            moe_grouped_gemm=False, moe_layer_freq=[1 if i in self.layers else 0 for i in range(num_layers)],
            moe_router_pre_softmax=self.pre_softmax, moe_router_score_function=self.score,
            moe_router_enable_expert_bias=self.expert_bias, moe_router_num_groups=self.groups,
            moe_router_group_topk=self.group_topk, moe_router_topk_scaling_factor=self.scaling,
            moe_router_load_balancing_type="aux_loss" if self.aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=self.aux_loss_coeff, moe_router_dtype="fp32",
            expert_model_parallel_size=parallel.ep, expert_tensor_parallel_size=parallel.expert_tp,
        )
        if self.expert_bias:
            kw["moe_router_bias_update_rate"] = self.bias_update_rate
        if self.shared_ffn:
            kw["moe_shared_expert_intermediate_size"] = self.shared_ffn
            kw["moe_shared_expert_gate"] = self.shared_gate
        return kw


def deepseek_router(c: HFConfig, layers: frozenset[int]) -> MoEShape:
    """The experts of a family with DeepSeek-V3's router (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash), read from its HF
    config `c`: sigmoid scores plus a per-expert correction bias (``e_score_correction_bias``, for selection only,
    updated by aux-loss-free balancing), the best ``topk_group`` of ``n_group`` groups, top-k within them, weights
    renormalised and scaled by ``routed_scaling_factor``, and ``n_shared_experts`` shared experts beside them.
    `layers` are the MoE layers (the family decides which are dense). Configs megatron's router cannot
    reproduce are refused, naming the keys."""
    from rlx.errors import RLXError

    where = f"model.path: a {c.model_type} checkpoint"
    if not getattr(c, "norm_topk_prob", True):
        raise RLXError(f"{where} with norm_topk_prob: false; megatron's sigmoid router always renormalises the "
                       f"top-k weights")
    groups = getattr(c, "n_group", None) or 1
    if groups > 1 and getattr(c, "topk_group", None) is None:
        raise RLXError(f"{where} with n_group {groups} and no topk_group")
    if groups > 1 and c.topk_group >= groups:  # every group is kept: no grouping, on both sides
        groups = 1
    if groups > 1 and c.num_experts_per_tok // c.topk_group != 2:
        raise RLXError(f"{where} with n_group {groups}, topk_group {c.topk_group} and num_experts_per_tok "
                       f"{c.num_experts_per_tok}: transformers scores a group by its best 2 experts, megatron by its "
                       f"best num_experts_per_tok // topk_group; they agree only when that is 2")
    scaling = float(getattr(c, "routed_scaling_factor", 1.0) or 1.0)
    return MoEShape(experts=c.n_routed_experts, topk=c.num_experts_per_tok, ffn=c.moe_intermediate_size,
                    layers=frozenset(layers), shared_ffn=(c.n_shared_experts or 0) * c.moe_intermediate_size,
                    score="sigmoid", expert_bias=True, groups=groups if groups > 1 else None,
                    group_topk=c.topk_group if groups > 1 else None, scaling=scaling if scaling != 1.0 else None)


def local_experts(stage: Stage, experts: int) -> range:
    """Global indices of the experts this rank holds, in local order."""
    n = experts // stage.ep
    return range(stage.ep_rank * n, (stage.ep_rank + 1) * n)


# -- HF -> megatron -------------------------------------------------------------------------------


def gated_mlp_to_megatron(ckpt: HFCheckpoint, hf: str, mg: str, rank: int, parts: int,
                          names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                          ) -> Iterator[tuple[str, Any]]:
    """A SwiGLU MLP at HF prefix `hf` (``{hf}gate_proj.weight``...) as megatron's ``{mg}linear_fc1/fc2``,
    split `parts` ways (this is part `rank`)."""
    import torch

    gate, up, down = names
    yield mg + "linear_fc1.weight", torch.cat([ckpt.shard(f"{hf}{gate}.weight", 0, rank, parts),
                                               ckpt.shard(f"{hf}{up}.weight", 0, rank, parts)], 0)
    yield mg + "linear_fc2.weight", ckpt.shard(f"{hf}{down}.weight", 1, rank, parts)


def router_to_megatron(ckpt: HFCheckpoint, hf: str, mg: str, shape: MoEShape) -> Iterator[tuple[str, Any]]:
    """The router (replicated on every rank): ``{hf}weight`` and, with expert bias, DeepSeek's
    ``{hf}e_score_correction_bias``."""
    yield mg + "weight", ckpt.get(hf + "weight")
    if shape.expert_bias:
        yield mg + "expert_bias", ckpt.get(hf + "e_score_correction_bias")


def experts_to_megatron(ckpt: HFCheckpoint, stage: Stage, hf: str, mg: str, experts: int,
                        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                        ) -> Iterator[tuple[str, Any]]:
    """This rank's routed experts, each read only in its expert-tensor-parallel slice (`names`: an expert's gate, up
    and down projections; Mixtral-style checkpoints call them w1, w3, w2)."""
    for j, e in enumerate(local_experts(stage, experts)):
        yield from gated_mlp_to_megatron(ckpt, f"{hf}{e}.", f"{mg}local_experts.{j}.", stage.etp_rank, stage.etp,
                                         names)


# -- megatron -> HF -------------------------------------------------------------------------------


def _unfuse(fc1_parts: list[Any], fc2_parts: list[Any]) -> tuple[Any, Any, Any]:
    import torch

    gates, ups = zip(*(p.chunk(2, 0) for p in fc1_parts), strict=True)
    return torch.cat(gates, 0), torch.cat(ups, 0), torch.cat(fc2_parts, 1)


def gated_mlp_to_hf(gather: Gather, hf: str, mg: str,
                    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> Iterator[tuple[str, Any]]:
    gate, up, down = _unfuse(gather(mg + "linear_fc1.weight"), gather(mg + "linear_fc2.weight"))
    yield f"{hf}{names[0]}.weight", gate
    yield f"{hf}{names[1]}.weight", up
    yield f"{hf}{names[2]}.weight", down


def router_to_hf(gather: Gather, hf: str, mg: str, shape: MoEShape) -> Iterator[tuple[str, Any]]:
    yield hf + "weight", gather(mg + "weight")[0]
    if shape.expert_bias:
        yield hf + "e_score_correction_bias", gather(mg + "expert_bias")[0]


def experts_to_hf(stage: Stage, gather: Gather, hf: str, mg: str, experts: int,
                  names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> Iterator[tuple[str, Any]]:
    """Every routed expert of the layer, gathered over expert (tensor) parallelism one local index at a time."""
    n = experts // stage.ep
    for j in range(n):
        fc1 = gather.experts(f"{mg}local_experts.{j}.linear_fc1.weight")
        fc2 = gather.experts(f"{mg}local_experts.{j}.linear_fc2.weight")
        for r, (a, b) in enumerate(zip(fc1, fc2, strict=True)):
            gate, up, down = _unfuse(a, b)
            e = r * n + j
            yield f"{hf}{e}.{names[0]}.weight", gate
            yield f"{hf}{e}.{names[1]}.weight", up
            yield f"{hf}{e}.{names[2]}.weight", down


class chunk_of_engine_routing:
    """While a tensor-parallel rank routes its part of the sequence (`split_sequence_around_experts`), the
    engine's routing the router carries (`RoutingReplay`) is cut to the same rows (pad rows: experts 0..k-1,
    not covered)."""

    def __init__(self, router: TopKRouter, seq: int, batch: int, pad: int, rank: int, n: int):
        self.router = router
        self.rows = slice(rank * n * batch, (rank + 1) * n * batch)
        self.pad_rows = pad * batch
        self.saved: tuple[Any, Any] = (None, None)

    def _cut(self, t: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        import torch

        if self.pad_rows:
            t = torch.cat([t, fill.to(t.device, t.dtype).expand(self.pad_rows, *t.shape[1:])])
        return t[self.rows]

    def __enter__(self) -> None:
        import torch

        engine = getattr(self.router, "_rlx_engine", None)
        rr = getattr(self.router, "router_replay", None)
        target = rr.target_topk_idx if rr is not None else None
        self.saved = (engine, target)
        if engine is not None:
            idx, covered = engine
            k = idx.shape[1]
            self.router._rlx_engine = (self._cut(idx, torch.arange(k)[None]), self._cut(covered, torch.zeros(1)))
        if rr is not None and target is not None:
            rr.target_topk_idx = self._cut(target, torch.arange(target.shape[1])[None])

    def __exit__(self, *exc: Any) -> None:
        engine, target = self.saved
        if engine is not None:
            self.router._rlx_engine = engine
        if target is not None:
            self.router.router_replay.target_topk_idx = target


def sum_router_grads(model: torch.nn.Module, group: ProcessGroup | None) -> None:
    """Sum the routers' gradients over the tensor-parallel `group` (see `split_sequence_around_experts`); call
    after the data-parallel reduction, as megatron's own tensor-parallel reductions run."""
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [getattr(p, "main_grad") for name, p in model.named_parameters()  # megatron DDP's gradient buffer
             if p.requires_grad and ".mlp.router." in name and getattr(p, "main_grad", None) is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    with torch.no_grad():
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)


def routers(model: torch.nn.Module) -> list[TopKRouter]:
    """The routers of the model's decoder layers (not those of trained multi-token-prediction layers, ``mtp.*``, which
    engines do not route with: no engine routing to replay, no per-layer statistics)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for name, m in model.named_modules() if isinstance(m, TopKRouter) and not name.startswith("mtp.")]


class RouterStats:
    """Per-layer routing statistics of a model's training forwards (forward-only passes, for log-probs or a
    reference, are not counted), reduced over every rank by `metrics`:

    * ``moe/aux_loss``: the switch-transformer load-balancing loss ``E * sum_e f_e * P_e`` before any coefficient,
      averaged over MoE layers (1.0 when perfectly balanced; ``f_e`` the fraction of routed slots that went to
      expert e, ``P_e`` its mean router score: softmax over all experts, or sigmoid normalised per token);
    * ``moe/load_max_mean``: the busiest expert's tokens over the mean expert's, averaged over layers, and
      ``moe/layer{L}/load_max_mean`` per layer L;
    * ``moe/tokens_dropped``: routed slots dropped for capacity, as a fraction of all (0 without a capacity factor);
    * with engine routing on the samples (`RoutingReplay`): ``moe/routing_agreement``, the fraction of (token,
      layer) pairs whose experts the trainer used were the engine's (1 with replay), and ``moe/natural_agreement``,
      the fraction the trainer's router would have picked by itself.

    Pad rows the tensor-parallel split adds (`split_sequence_around_experts`) are not counted.
    """

    def __init__(self, model: torch.nn.Module, spec_layers: int, experts: int, topk: int):
        self.experts, self.topk, self.layers = experts, topk, spec_layers
        self.routers = routers(model)
        self._reset()
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _reset(self) -> None:
        import torch

        self.counts = torch.zeros(self.layers, self.experts, dtype=torch.float64)
        self.scores = torch.zeros(self.layers, self.experts, dtype=torch.float64)
        self.tokens = torch.zeros(self.layers, dtype=torch.float64)
        self.seen = torch.zeros(self.layers, dtype=torch.float64)
        # tokens with engine routing, and of those, how many the router sent to the engine's experts (used) and
        # would have chosen by itself (natural)
        self.agree = torch.zeros(3, dtype=torch.float64)

    def _hook(self, router: TopKRouter, args: tuple[Any, ...], output: Any) -> None:  # megatron's router output
        import torch

        if not (router.training and torch.is_grad_enabled()):
            return
        hidden, pads = args[0], (args[1] if len(args) > 1 else None)
        _, routing_map = output
        with torch.no_grad():
            logits = router.gating(hidden).reshape(-1, self.experts).double()
            keep = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
            if pads is not None:
                keep = ~pads.reshape(-1).bool()
            logits, routed = logits[keep], routing_map.reshape(-1, self.experts)[keep]
            if router.score_function == "sigmoid":
                s = torch.sigmoid(logits)
                scores = s / s.sum(-1, keepdim=True).clamp_min(1e-20)
            else:
                scores = torch.softmax(logits, -1)
            layer = router.layer_number - 1  # megatron numbers layers from 1, globally
            engine = getattr(router, "_rlx_engine", None)
            if engine is not None:
                self._agreement(router, logits, routed, engine[0][keep], engine[1][keep].bool())
            self.counts[layer] += routed.sum(0).double().cpu()
            self.scores[layer] += scores.sum(0).cpu()
            self.tokens[layer] += logits.shape[0]
            self.seen[layer] = 1

    def _agreement(self, router: TopKRouter, logits: torch.Tensor, used: torch.Tensor, engine: torch.Tensor,
                   covered: torch.Tensor) -> None:
        """Count covered tokens whose experts (as a set) were the engine's: those the router used (replayed or
        chosen), and those its own top-k picks (megatron's routing function, without replay)."""
        import torch
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        c = router.config
        _, natural = topk_routing_with_score_function(
            logits.float(), self.topk, use_pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
            group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
            score_function=router.score_function, expert_bias=router.expert_bias, fused=False)
        want = torch.zeros_like(used, dtype=torch.bool).scatter_(1, engine.to(used.device).long(), True)
        self.agree[0] += float(covered.sum())
        self.agree[1] += float(((used.bool() == want).all(1) & covered).sum())
        self.agree[2] += float(((natural.bool() == want).all(1) & covered).sum())

    def metrics(self) -> dict[str, float]:
        """Reduce over all ranks (collective) and start counting afresh."""
        import torch
        import torch.distributed as dist

        flat = torch.cat([self.counts.flatten(), self.scores.flatten(), self.tokens, self.seen, self.agree])
        dist.all_reduce(flat)
        L, E = self.layers, self.experts
        counts, scores = flat[:L * E].view(L, E), flat[L * E:2 * L * E].view(L, E)
        tokens, seen = flat[2 * L * E:2 * L * E + L], flat[2 * L * E + L:2 * L * E + 2 * L]
        agree = flat[2 * L * E + 2 * L:]
        self._reset()
        out: dict[str, float] = {}
        if agree[0]:  # token-layer pairs with engine routing
            out["moe/routing_agreement"] = float(agree[1] / agree[0])
            out["moe/natural_agreement"] = float(agree[2] / agree[0])
        aux, load, dropped, slots = [], [], 0.0, 0.0
        for layer in range(L):
            if not seen[layer] or not tokens[layer]:
                continue
            t = float(tokens[layer])
            routed = float(counts[layer].sum())
            f = counts[layer] / max(routed, 1.0)
            p = scores[layer] / t
            aux.append(float(E * (f * p).sum()))
            mean = routed / E
            load.append(float(counts[layer].max()) / mean if mean else 0.0)
            out[f"moe/layer{layer}/load_max_mean"] = load[-1]
            dropped += t * self.topk - routed
            slots += t * self.topk
        if aux:
            out["moe/aux_loss"] = sum(aux) / len(aux)
            out["moe/load_max_mean"] = sum(load) / len(load)
            out["moe/tokens_dropped"] = dropped / slots if slots else 0.0
        return out


# -- rollout routing replay (R3) --------------------------------------------------------------------


def engine_routing(batch: PackedBatch, layers: int, topk: int, required: bool,
                   experts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The experts the engine routed each token of a packed micro-batch to: ``(indices [R, W, layers, top_k],
    covered [R, W])`` from the samples' ``routed_experts`` (SGLang's int32 [rows, layers, top_k], rows <= the
    sample's tokens - 1). Positions no engine routing covers (each sample's last token, pads, samples without
    routing) hold experts 0..k-1 and are not covered: none of them feeds a trained log-prob. None when no sample
    carries routing; with `required` (replay), a sample without it is an error."""
    import base64

    import numpy as np
    import torch

    from rlx.errors import RLXError

    if not any(s.routed_experts for s in batch.samples):
        if required and batch.samples:
            raise _no_routing(batch.samples[0])
        return None
    rows, width = batch.input_ids.shape
    idx = torch.arange(topk, dtype=torch.long).expand(rows, width, layers, topk).clone()
    covered = torch.zeros(rows, width, dtype=torch.bool)
    for s, (r, c) in zip(batch.samples, batch.starts, strict=True):
        if not s.routed_experts:
            if required:
                raise _no_routing(s)
            continue
        flat = np.frombuffer(base64.b64decode(s.routed_experts), dtype=np.int32)
        if flat.size % (layers * topk):
            raise RLXError(f"sample {s.sample_id}: its routed experts ({flat.size} ids) are not whole tokens of "
                           f"{layers} layers x top-{topk}: the engine serves another model than the trainer")
        a = torch.from_numpy(flat.copy()).view(-1, layers, topk)
        if a.numel() and (int(a.min()) < 0 or int(a.max()) >= experts):
            raise RLXError(f"sample {s.sample_id}: the engine routed tokens to expert {int(a.max())} (or below 0), "
                           f"but the model has {experts} experts: an engine with redundant or remapped (physical) "
                           f"experts (SGLang's expert-location/EPLB options) reports ids the trainer cannot replay")
        if a.shape[0] > s.total_len - 1:
            raise RLXError(f"sample {s.sample_id}: routed experts for {a.shape[0]} tokens, but it has "
                           f"{s.total_len} (at most {s.total_len - 1} are routed)")
        idx[r, c:c + a.shape[0]] = a.long()
        covered[r, c:c + a.shape[0]] = True
    return idx, covered


def _no_routing(sample: Sample) -> Exception:
    from rlx.errors import RLXError

    return RLXError(f"train.objective.routing_replay: sample {sample.sample_id} carries no routed experts; engines "
                    f"must report them (SGLang >= 0.5.6 with --enable-return-routed-experts, which rlx sets on "
                    f"engines it launches; attached engines need it at their launch), and its generator must keep "
                    f"them (rlx.rollout.context.append_model_tokens does)")


class RoutingReplay:
    """One model role's routers fed the engine's routing, micro-batch by micro-batch: with `replay` megatron's
    router replay takes those experts (REPLAY_FORWARD; no recomputation, so the backward needs none), and either
    way the routers carry them for `RouterStats` to compare with what they chose. The role's own routers are
    set directly, never through megatron's global list, which a second model (the reference) joins too."""

    def __init__(self, model: torch.nn.Module, layers: int, topk: int, replay: bool, experts: int):
        self.routers = routers(model)
        self.layers, self.topk, self.replay, self.experts = layers, topk, replay, experts

    def set(self, batch: PackedBatch) -> torch.Tensor | None:
        """Set the batch's engine routing on the routers; returns, with replay, the [R, W] positions replayed with
        placeholder experts (no engine routing), for the caller to mask out of routing statistics."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if not self.routers:  # a pipeline stage of dense layers only
            return None
        got = engine_routing(batch, self.layers, self.topk, self.replay, self.experts)
        if got is not None:
            dev = self.routers[0].weight.device
            got = (got[0].to(dev), got[1].to(dev))
        for router in self.routers:
            router._rlx_engine = None
            if got is None:
                continue
            idx, covered = got
            rows, width = covered.shape
            mine = idx[:, :, router.layer_number - 1].transpose(0, 1).reshape(width * rows, self.topk)  # seq-major
            router._rlx_engine = (mine, covered.t().reshape(-1))
            if self.replay:
                rr = router.router_replay
                rr.clear_indices()
                rr.set_target_indices(mine)
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return ~got[1].cpu() if (got is not None and self.replay) else None

    def clear(self) -> None:
        for router in self.routers:
            router._rlx_engine = None
            if self.replay:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
