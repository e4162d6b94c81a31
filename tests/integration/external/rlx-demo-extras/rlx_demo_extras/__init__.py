"""Three components written against rlx's public contracts only, to show that a plugin outside the
repository needs no change to rlx:

* ``phi3``: a model bridge for Phi-3 (fused ``qkv_proj`` and ``gate_up_proj`` in the HF checkpoint);
* ``one-by-one``: a weight transport sending one tensor per request over the engines' tensor API;
* ``vanilla_pg``: the plain policy-gradient loss ``-A * log p`` (no ratio, no clipping).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from rlx import hookimpl
from rlx.train.balance import FlopsModel
from rlx.train.spec import ModelSpec, fuse_qkv, rope_theta, split_qkv


@dataclass
class Phi3Spec(ModelSpec):
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    ffn: int = 0
    eps: float = 1e-5

    def transformer_config(self, parallel, dtype, **common):
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=self.heads,
            num_query_groups=self.kv_heads, kv_channels=self.head_dim, ffn_hidden_size=self.ffn,
            normalization="RMSNorm", layernorm_epsilon=self.eps, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
            attention_dropout=0.0, tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp, params_dtype=dtype, bf16=dtype == torch.bfloat16,
            use_cpu_initialization=True, pipeline_dtype=dtype, **common)

    def layer_spec(self, config, stage):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(normalization="RMSNorm")

    def _qkv_sizes(self):
        return [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]

    def to_megatron(self, ckpt, stage):
        import torch

        r, tp = stage.tp_rank, stage.tp

        def part(t, dim):
            return t.chunk(tp, dim=dim)[r].contiguous() if tp > 1 else t

        if stage.first:
            yield "embedding.word_embeddings.weight", ckpt.shard("model.embed_tokens.weight", 0, r, tp)
        for local, layer in enumerate(stage.layers()):
            h, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
            yield m + "input_layernorm.weight", ckpt.get(h + "input_layernorm.weight")
            q, k, v = ckpt.get(h + "self_attn.qkv_proj.weight").split(self._qkv_sizes(), 0)
            yield m + "self_attention.linear_qkv.weight", fuse_qkv(part(q, 0), part(k, 0), part(v, 0),
                                                                     self.heads // tp, self.kv_heads // tp,
                                                                     self.head_dim)
            yield m + "self_attention.linear_proj.weight", ckpt.shard(h + "self_attn.o_proj.weight", 1, r, tp)
            yield m + "pre_mlp_layernorm.weight", ckpt.get(h + "post_attention_layernorm.weight")
            gate, up = ckpt.get(h + "mlp.gate_up_proj.weight").chunk(2, 0)
            yield m + "mlp.linear_fc1.weight", torch.cat([part(gate, 0), part(up, 0)], 0)
            yield m + "mlp.linear_fc2.weight", ckpt.shard(h + "mlp.down_proj.weight", 1, r, tp)
        if stage.last:
            yield "decoder.final_layernorm.weight", ckpt.get("model.norm.weight")
            name = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
            if not self.tied or not stage.first:
                yield "output_layer.weight", ckpt.shard(name, 0, r, tp)

    def to_hf(self, stage, gather):
        import torch

        if stage.first:
            yield "model.embed_tokens.weight", torch.cat(gather("embedding.word_embeddings.weight"), 0)
        for local, layer in enumerate(stage.layers()):
            h, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
            yield h + "input_layernorm.weight", gather(m + "input_layernorm.weight")[0]
            q, k, v = split_qkv(torch.cat(gather(m + "self_attention.linear_qkv.weight"), 0), self.heads,
                                self.kv_heads, self.head_dim)
            yield h + "self_attn.qkv_proj.weight", torch.cat([q, k, v], 0)
            yield h + "self_attn.o_proj.weight", torch.cat(gather(m + "self_attention.linear_proj.weight"), 1)
            yield h + "post_attention_layernorm.weight", gather(m + "pre_mlp_layernorm.weight")[0]
            gates, ups = zip(*(s.chunk(2, 0) for s in gather(m + "mlp.linear_fc1.weight")))
            yield h + "mlp.gate_up_proj.weight", torch.cat([*gates, *ups], 0)
            yield h + "mlp.down_proj.weight", torch.cat(gather(m + "mlp.linear_fc2.weight"), 1)
        if stage.last:
            yield "model.norm.weight", gather("decoder.final_layernorm.weight")[0]
            if not self.tied:
                yield "lm_head.weight", torch.cat(gather("output_layer.weight"), 0)
            elif not stage.first:
                yield "model.embed_tokens.weight", torch.cat(gather("output_layer.weight"), 0)


class Phi3Bridge:
    name = "phi3"
    model_types = ("phi3",)

    def spec(self, hf_config):
        c = hf_config
        heads, kv = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
        return Phi3Spec(model_type=c.model_type, hf_config=c, num_layers=c.num_hidden_layers,
                        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                        max_positions=c.max_position_embeddings, tied=bool(c.tie_word_embeddings),
                        rope_theta=rope_theta(c),
                        flops=FlopsModel.from_shape(c.hidden_size, c.num_hidden_layers, c.intermediate_size,
                                                    c.vocab_size, kv, heads),
                        heads=heads, kv_heads=kv, head_dim=c.hidden_size // heads, ffn=c.intermediate_size,
                        eps=c.rms_norm_eps)


class OneByOne:
    """Each tensor in its own ``/update_weights_from_tensor`` request; the version set at commit."""

    name = "one-by-one"

    async def setup(self, ctx) -> None:
        pass

    async def send(self, named, version, ctx) -> None:
        from rlx.transport import update_sessions
        from rlx.transport.payloads import serialize_named_tensors

        async with update_sessions(ctx.engines):
            for name, t in named:
                payload = serialize_named_tensors([(name, t)])

                async def one(engine, payload=payload):
                    async with engine.client() as c:
                        await c.update_weights_from_tensor([payload] * engine.tp_size)

                await asyncio.gather(*(one(e) for e in ctx.engines))

    async def commit(self, version, ctx) -> None:
        async def one(engine):
            async with engine.client() as c:
                await c.update_weight_version(str(version))

        await asyncio.gather(*(one(e) for e in ctx.engines))

    async def close(self) -> None:
        pass


class VanillaPG:
    name = "vanilla_pg"

    def loss(self, inputs: Any):
        import torch

        return -inputs.advantages * inputs.logprobs, torch.zeros_like(inputs.logprobs, dtype=torch.bool)


@hookimpl
def register_models(register):
    register(Phi3Bridge)


@hookimpl
def register_transports(register):
    register(OneByOne)


@hookimpl
def register_losses(register):
    register(VanillaPG)
