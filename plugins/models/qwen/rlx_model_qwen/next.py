"""Qwen3-Next (``qwen3_next``) and Qwen3.5 text (``qwen3_5_text``, ``qwen3_5_moe_text``): hybrid decoders of gated
delta net (GDN) layers and gated full-attention layers (``layer_types``), with zero-centred RMSNorms, partial
rotary embeddings, and experts with a gated shared expert (Qwen3-Next, Qwen3.5-MoE) or dense MLPs (Qwen3.5).

On megatron-core (local specs), layer by layer:

* ``linear_attention`` layers take rlx's GDN layer (`rlx.train.gdn.GatedDeltaNet`) in the ``self_attention``
  slot; its gated delta rule comes from the kernels hook (``model.kernels: {gdn: ...}``, `rlx-kernel-flashqla`).
  HF's projections are regrouped per tensor-parallel rank into ``in_proj`` rows ``[q | k | v | z | b | a]`` of
  the rank's own key heads: from Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per key head) or
  Qwen3.5's flat ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``; the convolution's channels
  likewise (``[q | k | v]`` of the rank's heads).
* ``full_attention`` layers are megatron's self-attention with ``attention_output_gate``: HF's ``q_proj`` holds
  each head's query and gate one after the other; megatron's ``linear_qkv`` holds, per query group, the group's
  queries, then their gates, then the group's key and value.
* Every norm but the GDN output norm is ``x / rms(x) * (1 + w)`` (`rlx.train.gdn.ZeroCenteredRMSNorm`), so the
  weights map as stored.

The FLOPs model counts every layer as attention (GDN layers cost less per token at long lengths).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rlx.errors import RLXError
from rlx.train.decoder import DecoderSpec, decoder_flops
from rlx.train.moe import MoEShape
from rlx.train.spec import Gather, HFCheckpoint, Stage, rope_theta, tp_chunk, wrapped


@dataclass(frozen=True)
class GDNShape:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv: int  # the causal convolution's width
    flat: bool  # Qwen3.5's in_proj_qkv / z / b / a (else Qwen3-Next's grouped in_proj_qkvz / ba)

    @property
    def per_key(self) -> int:
        return self.value_heads // self.key_heads


def layer_types(c: Any) -> tuple[str, ...]:
    types = getattr(c, "layer_types", None)
    if types is None:
        every = getattr(c, "full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(c.num_hidden_layers)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != c.num_hidden_layers:
        raise RLXError(f"{c.model_type}: layer_types {list(types)} must give linear_attention or full_attention for "
                       f"each of the {c.num_hidden_layers} layers")
    return tuple(types)


def partial_rotary(c: Any) -> float:
    rope = getattr(c, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 0.25)))


@dataclass
class QwenNextSpec(DecoderSpec):
    layer_types: tuple[str, ...] = ()
    gdn: GDNShape = field(kw_only=True)

    def linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    # -- megatron side ---------------------------------------------------------------------------

    def config_kwargs(self, parallel: Any, dtype: Any) -> dict[str, Any]:
        g = self.gdn
        if self.kv_heads % parallel.tp or g.key_heads % parallel.tp:
            raise RLXError(f"{self.model_type}: tensor parallelism {parallel.tp} must divide the {self.kv_heads} "
                           f"key-value heads and the {g.key_heads} GDN key heads")
        return {**super().config_kwargs(parallel, dtype), "attention_output_gate": True,
                "linear_conv_kernel_dim": g.conv, "linear_key_head_dim": g.key_dim,
                "linear_value_head_dim": g.value_dim, "linear_num_key_heads": g.key_heads,
                "linear_num_value_heads": g.value_heads,
                # layers of two kinds: checkpoints key each layer on its own (megatron stacks homogeneous layers
                # along one axis, which a dense Qwen3.5's attention and GDN layers each leave half empty)
                "hetereogenous_dist_checkpoint": True}

    def layer_spec(self, config: Any, stage: Stage) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from rlx.train.attention import SDPACoreAttention
        from rlx.train.gdn import GatedDeltaNet, ZeroCenteredRMSNorm

        dense = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        experts = (get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                            qk_layernorm=True, normalization="RMSNorm") if self.moe else None)
        in_proj = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a") if self.gdn.flat else ("in_proj_qkvz",
                                                                                                  "in_proj_ba")
        gdn = ModuleSpec(module=GatedDeltaNet, params={"kernel": functools.partial(self.kernel, "gdn"),
                                                       "hf_in_proj": in_proj})
        specs = []
        for layer in stage.layers():
            spec = copy.deepcopy(experts if experts is not None and self.is_moe_layer(layer) else dense)
            sub = spec.submodules
            sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
            if self.linear(layer):
                sub.self_attention = gdn
            else:
                att = sub.self_attention.submodules
                att.core_attention = SDPACoreAttention
                att.q_layernorm = att.k_layernorm = ZeroCenteredRMSNorm
            specs.append(spec)
        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=ZeroCenteredRMSNorm)

    # -- HF <-> megatron -------------------------------------------------------------------------

    @staticmethod
    def _layer(h: str) -> int:
        return int(h.rstrip(".").rsplit(".", 1)[1])

    def attention_to_megatron(self, ckpt: HFCheckpoint, stage: Stage, h: str, m: str) -> Iterator[tuple[str, Any]]:
        if self.linear(self._layer(h)):
            yield from self._gdn_to_megatron(ckpt, stage, h + "linear_attn.", m + "self_attention.")
            return
        import torch

        r, tp, hd = stage.tp_rank, stage.tp, self.head_dim
        per = self.heads // self.kv_heads
        qg = ckpt.shard(h + "self_attn.q_proj.weight", 0, r, tp)
        hidden = qg.shape[-1]
        qg = qg.reshape(self.kv_heads // tp, per, 2, hd, hidden)  # this rank's groups; per head [query | gate]
        k, v = (ckpt.shard(h + f"self_attn.{p}_proj.weight", 0, r, tp).reshape(-1, 1, hd, hidden) for p in "kv")
        fused = torch.cat([qg[:, :, 0].reshape(-1, per * hd, hidden), qg[:, :, 1].reshape(-1, per * hd, hidden),
                           k.reshape(-1, hd, hidden), v.reshape(-1, hd, hidden)], dim=1)
        yield m + "self_attention.linear_qkv.weight", fused.reshape(-1, hidden)
        yield m + "self_attention.q_layernorm.weight", ckpt.get(h + "self_attn.q_norm.weight")
        yield m + "self_attention.k_layernorm.weight", ckpt.get(h + "self_attn.k_norm.weight")
        yield m + "self_attention.linear_proj.weight", ckpt.shard(h + "self_attn.o_proj.weight", 1, r, tp)

    def attention_to_hf(self, gather: Gather, h: str, m: str) -> Iterator[tuple[str, Any]]:
        if self.linear(self._layer(h)):
            yield from self._gdn_to_hf(gather, h + "linear_attn.", m + "self_attention.")
            return
        import torch

        hd, per = self.head_dim, self.heads // self.kv_heads
        fused = torch.cat(gather(m + "self_attention.linear_qkv.weight"), 0)
        hidden = fused.shape[-1]
        q, gate, k, v = fused.reshape(self.kv_heads, (2 * per + 2) * hd, hidden).split(
            [per * hd, per * hd, hd, hd], dim=1)
        qg = torch.stack([q.reshape(self.heads, hd, hidden), gate.reshape(self.heads, hd, hidden)], dim=1)
        yield h + "self_attn.q_proj.weight", qg.reshape(-1, hidden)
        yield h + "self_attn.k_proj.weight", k.reshape(-1, hidden)
        yield h + "self_attn.v_proj.weight", v.reshape(-1, hidden)
        yield h + "self_attn.q_norm.weight", gather(m + "self_attention.q_layernorm.weight")[0]
        yield h + "self_attn.k_norm.weight", gather(m + "self_attention.k_layernorm.weight")[0]
        yield h + "self_attn.o_proj.weight", torch.cat(gather(m + "self_attention.linear_proj.weight"), 1)

    def _gdn_to_megatron(self, ckpt: HFCheckpoint, stage: Stage, h: str, m: str) -> Iterator[tuple[str, Any]]:
        import torch

        g, r, tp = self.gdn, stage.tp_rank, stage.tp
        kd, vd = g.key_heads * g.key_dim, g.value_heads * g.value_dim
        if g.flat:
            qkv = ckpt.get(h + "in_proj_qkv.weight")
            q, k, v = (tp_chunk(x, 0, r, tp) for x in qkv.split([kd, kd, vd]))
            z, b, a = (ckpt.shard(h + f"in_proj_{p}.weight", 0, r, tp) for p in "zba")
        else:  # grouped per key head: [q | k | v | z] and [b | a] of each; a rank's key heads are contiguous
            qkvz = ckpt.shard(h + "in_proj_qkvz.weight", 0, r, tp)
            hidden = qkvz.shape[-1]
            per = g.per_key
            q, k, v, z = (x.reshape(-1, hidden) for x in qkvz.reshape(g.key_heads // tp, -1, hidden).split(
                [g.key_dim, g.key_dim, per * g.value_dim, per * g.value_dim], dim=1))
            b, a = (x.reshape(-1, hidden) for x in ckpt.shard(h + "in_proj_ba.weight", 0, r, tp).reshape(
                g.key_heads // tp, 2 * per, hidden).split([per, per], dim=1))
        yield m + "in_proj.weight", torch.cat([q, k, v, z, b, a])
        conv = ckpt.get(h + "conv1d.weight")
        yield m + "conv1d.weight", torch.cat([tp_chunk(x, 0, r, tp) for x in conv.split([kd, kd, vd])])
        yield m + "dt_bias", ckpt.shard(h + "dt_bias", 0, r, tp)
        yield m + "A_log", ckpt.shard(h + "A_log", 0, r, tp)
        yield m + "out_norm.weight", ckpt.get(h + "norm.weight")
        yield m + "out_proj.weight", ckpt.shard(h + "out_proj.weight", 1, r, tp)

    def _gdn_to_hf(self, gather: Gather, h: str, m: str) -> Iterator[tuple[str, Any]]:
        import torch

        g = self.gdn
        ranks = gather(m + "in_proj.weight")
        tp = len(ranks)
        kl, vl, nl = g.key_heads * g.key_dim // tp, g.value_heads * g.value_dim // tp, g.value_heads // tp
        parts = [x.split([kl, kl, vl, vl, nl, nl]) for x in ranks]  # per rank: q, k, v, z, b, a
        hidden = ranks[0].shape[-1]
        if g.flat:
            yield h + "in_proj_qkv.weight", torch.cat([p[i] for i in range(3) for p in parts])
            for i, name in ((3, "z"), (4, "b"), (5, "a")):
                yield h + f"in_proj_{name}.weight", torch.cat([p[i] for p in parts])
        else:
            per, heads = g.per_key, g.key_heads // tp
            yield h + "in_proj_qkvz.weight", torch.cat([torch.cat(
                [p[0].reshape(heads, -1, hidden), p[1].reshape(heads, -1, hidden),
                 p[2].reshape(heads, -1, hidden), p[3].reshape(heads, -1, hidden)], dim=1).reshape(-1, hidden)
                for p in parts])
            yield h + "in_proj_ba.weight", torch.cat([torch.cat(
                [p[4].reshape(heads, per, hidden), p[5].reshape(heads, per, hidden)], dim=1).reshape(-1, hidden)
                for p in parts])
        conv = [x.split([kl, kl, vl]) for x in gather(m + "conv1d.weight")]
        yield h + "conv1d.weight", torch.cat([c[i] for i in range(3) for c in conv])
        yield h + "dt_bias", torch.cat(gather(m + "dt_bias"))
        yield h + "A_log", torch.cat(gather(m + "A_log"))
        yield h + "norm.weight", gather(m + "out_norm.weight")[0]
        yield h + "out_proj.weight", torch.cat(gather(m + "out_proj.weight"), 1)


def next_spec(c: Any, moe: MoEShape | None, flat: bool) -> QwenNextSpec:
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    ffn = getattr(c, "intermediate_size", None) or 0
    gdn = GDNShape(key_heads=c.linear_num_key_heads, value_heads=c.linear_num_value_heads,
                   key_dim=c.linear_key_head_dim, value_dim=c.linear_value_head_dim, conv=c.linear_conv_kernel_dim,
                   flat=flat)
    if gdn.value_heads % gdn.key_heads:
        raise RLXError(f"{c.model_type}: linear_num_value_heads {gdn.value_heads} must be a multiple of "
                       f"linear_num_key_heads {gdn.key_heads}")
    return QwenNextSpec(
        model_type=c.model_type, hf_config=c, num_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
        hidden_size=c.hidden_size, max_positions=c.max_position_embeddings,
        tied=bool(getattr(c, "tie_word_embeddings", False)), rope_theta=rope_theta(c),
        rotary_percent=partial_rotary(c),
        flops=decoder_flops(c.hidden_size, c.num_hidden_layers, ffn or (moe.ffn if moe else 0), c.vocab_size,
                            kv_heads, heads, moe),
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn, rms_eps=c.rms_norm_eps, qk_norm=True,
        moe=moe, hf_shared="mlp.shared_expert", hf_shared_gate="mlp.shared_expert_gate",
        layer_types=layer_types(c), gdn=gdn,
    )


def next_experts(c: Any, layers: frozenset[int], pre_softmax: bool) -> MoEShape:
    return MoEShape(experts=c.num_experts, topk=c.num_experts_per_tok, ffn=c.moe_intermediate_size, layers=layers,
                    shared_ffn=getattr(c, "shared_expert_intermediate_size", 0) or 0,
                    shared_gate=bool(getattr(c, "shared_expert_intermediate_size", 0)), pre_softmax=pre_softmax)


class Qwen3NextBridge:
    name = "qwen3-next"
    model_types = ("qwen3_next",)

    def spec(self, hf_config: Any) -> QwenNextSpec:
        from rlx_model_qwen import moe_layers

        c = hf_config
        return next_spec(c, next_experts(c, moe_layers(c), not c.norm_topk_prob) if c.num_experts else None,
                         flat=False)


PUBLISHED = (("model.", "model.language_model."), ("lm_head.", "lm_head."))  # the wrapper's names of the text model's


class Qwen35Bridge:
    """Qwen3.5: dense (``qwen3_5_text``) and with experts in every layer (``qwen3_5_moe_text``, top-k renormalised);
    the checkpoints Qwen publishes (``qwen3_5``, ``qwen3_5_moe``) wrap that language model
    (``model.language_model.*``, its ``text_config``) beside a vision tower (``model.visual.*``), which is not
    trained and is written back unchanged by export. Text-only positions: the multimodal rotary embedding is then
    the plain partial one."""

    name = "qwen3.5"
    model_types = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")

    def spec(self, hf_config: Any) -> QwenNextSpec:
        c = hf_config
        if c.model_type in ("qwen3_5", "qwen3_5_moe"):
            return wrapped(self.spec(c.text_config), c, PUBLISHED)
        if c.model_type == "qwen3_5_moe_text":
            return next_spec(c, next_experts(c, frozenset(range(c.num_hidden_layers)), False), flat=True)
        return next_spec(c, None, flat=True)
