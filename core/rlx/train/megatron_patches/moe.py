"""megatron-core's MoE layer and router as rlx trains them (megatron-core 0.16.1; `rlx.train.model.ModelRole`
applies them when the model has experts)."""

from __future__ import annotations

from rlx.train.moe import chunk_of_engine_routing


def split_sequence_around_experts() -> None:
    """MoE layers under tensor parallelism without sequence parallelism, trained correctly.

    megatron-core's MoE layer assumes sequence parallelism when tensor parallelism is on: its token dispatcher
    all-gathers tokens over the expert-tensor-parallel ranks as if each held a different part of the sequence.
    Without it (rlx's local layer spec: torch norms refuse sequence parallelism) every tensor-parallel rank holds
    the whole sequence, so each token is processed once per rank and expert gradients come out ``tp`` times too
    large (megatron refuses to train that way, calling it a performance problem). This does locally what
    sequence parallelism does around the layer: each rank routes its 1/tp of the sequence (padded to a multiple
    of tp, the pad rows masked out of the router's statistics), the routed experts run as megatron intends, and
    the outputs are gathered back (the gradient of a replicated output is split, not summed). Shared experts run
    on the whole sequence, as the dense MLP they are. Each rank's router then sees only its part of the tokens,
    so router gradients are summed over tensor-parallel ranks after the backward (`sum_router_grads`), as
    megatron does for them under sequence parallelism.
    """
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if getattr(MoELayer, "_rlx_split_sequence", False):
        return
    forward = MoELayer.forward

    def split_forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        import torch

        group = self.attn_tp_group
        tp = group.size()
        if tp == 1 or self.config.sequence_parallel or intermediate_tensors is not None:
            return forward(self, hidden_states, intermediate_tensors, padding_mask)
        seq, batch = hidden_states.shape[:2]
        pad = (-seq) % tp
        shared = self.shared_experts(hidden_states) if self.use_shared_expert else None
        if pad:
            hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, 0, 0, pad))
        mine = scatter_to_sequence_parallel_region(hidden_states, group=group)
        n, rank = mine.shape[0], group.rank()
        pads = torch.zeros(seq + pad, batch, dtype=torch.bool, device=mine.device)  # [seq, batch], True: a pad
        pads[seq:] = True
        if padding_mask is not None:
            pads[:seq] |= padding_mask.transpose(0, 1).bool()
        pads = pads[rank * n:(rank + 1) * n]
        with chunk_of_engine_routing(self.router, seq, batch, pad, rank, n):
            probs, routing_map = self.route(mine, pads if (pad or padding_mask is not None) else None)
        x, probs = self.preprocess(mine, probs, routing_map)
        x, probs = self.dispatch(x, probs)
        out, bias = self.routed_experts_compute(x, probs)
        out = self.postprocess(self.combine(out), None)
        out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False, group=group)[:seq]
        return (out + shared if shared is not None else out), bias

    MoELayer.forward = split_forward
    MoELayer._rlx_split_sequence = True


def expert_bias_with_padding() -> None:
    """megatron-core 0.16.1 counts tokens per expert for the expert bias as ``routing_map & ~padding_mask`` with the
    mask flattened to [tokens] against a [tokens, experts] map, which fails (or, with as many tokens as experts,
    masks the wrong entries) whenever a padding mask is given: the mask is made a column here."""
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(TopKRouter, "_rlx_column_mask", False):
        return
    apply = TopKRouter._apply_expert_bias

    def with_column_mask(self, routing_map, padding_mask=None):
        if padding_mask is not None and padding_mask.dim() == 1:
            padding_mask = padding_mask[:, None]
        return apply(self, routing_map, padding_mask)

    TopKRouter._apply_expert_bias = with_column_mask
    TopKRouter._rlx_column_mask = True
