"""Mixture-of-experts helpers that need no megatron model: router statistics and the expert layout."""

import pytest
import torch
import torch.distributed as dist

from rlx.train.moe import MoEShape, RouterStats, local_experts
from rlx.train.spec import Stage


@pytest.fixture
def one_rank_group():
    from rlx.net import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_router_metrics_by_hand(one_rank_group):
    stats = RouterStats.__new__(RouterStats)  # the counting hook is exercised by the plugins' parallel tests
    stats.experts, stats.topk, stats.layers = 4, 2, 3
    stats._reset()
    # layer 0: 3 tokens, 6 slots routed [3, 1, 0, 2], mean scores [.4, .2, .1, .3]
    stats.counts[0] = torch.tensor([3.0, 1, 0, 2])
    stats.scores[0] = torch.tensor([1.2, 0.6, 0.3, 0.9])
    stats.tokens[0], stats.seen[0] = 3, 1
    # layer 1: 2 tokens, one of 4 slots dropped, uniform scores
    stats.counts[1] = torch.tensor([1.0, 1, 0, 1])
    stats.scores[1] = torch.tensor([0.5, 0.5, 0.5, 0.5])
    stats.tokens[1], stats.seen[1] = 2, 1
    # layer 2: dense (never seen)
    m = stats.metrics()
    # f = [1/2, 1/6, 0, 1/3], P = [.4, .2, .1, .3]: 4 * (.2 + 1/30 + 0 + .1) = 4/3
    # f = [1/3, 1/3, 0, 1/3], P = .25 each: 4 * 3 * (1/12) = 1
    assert m["moe/aux_loss"] == pytest.approx((4 / 3 + 1) / 2)
    assert m["moe/layer0/load_max_mean"] == pytest.approx(3 / 1.5)
    assert m["moe/layer1/load_max_mean"] == pytest.approx(1 / 0.75)
    assert m["moe/load_max_mean"] == pytest.approx((2 + 4 / 3) / 2)
    assert m["moe/tokens_dropped"] == pytest.approx(1 / 10)
    assert "moe/layer2/load_max_mean" not in m
    assert float(stats.counts.sum()) == 0 and stats.metrics() == {}  # counting starts afresh


def test_experts_split_evenly_over_expert_parallel_ranks():
    stage = Stage(0, 2, True, True, ep_rank=1, ep=4)
    assert list(local_experts(stage, 8)) == [2, 3]


def test_megatron_settings_follow_the_shape():
    from rlx.config import ParallelConfig

    kw = MoEShape(8, 2, 16, frozenset({1, 3}), shared_ffn=32, score="sigmoid", expert_bias=True, groups=4,
                  group_topk=2, scaling=2.5).transformer_kwargs(4, ParallelConfig(world_size=4, ep=2, tp=2))
    assert kw["moe_layer_freq"] == [0, 1, 0, 1] and kw["moe_router_score_function"] == "sigmoid"
    assert kw["moe_shared_expert_intermediate_size"] == 32 and kw["moe_router_enable_expert_bias"]
    assert kw["expert_model_parallel_size"] == 2 and kw["expert_tensor_parallel_size"] == 2
    assert kw["moe_router_load_balancing_type"] == "none" and kw["moe_grouped_gemm"] is False


def _routed(rows, layers=2, topk=2, value=None):
    import base64

    import numpy as np

    a = np.zeros((rows, layers, topk), dtype=np.int32) if value is None else np.full((rows, layers, topk), value,
                                                                                        dtype=np.int32)
    if value is None:
        a[:, :, 1] = 1 + np.arange(rows)[:, None] % 3
    return base64.b64encode(a.tobytes()).decode()


def test_engine_routing_is_placed_where_each_sample_sits_in_the_packed_rows():
    from rlx.train.moe import engine_routing
    from rlx.train.packing import pack
    from rlx.types import Sample

    a = Sample([1, 2, 3], [4, 5], [1, 1], [0.0, 0.0], sample_id=0, routed_experts=_routed(4))
    b = Sample([6], [7, 8], [1, 1], [0.0, 0.0], sample_id=1, routed_experts=_routed(1))  # covers less: allowed
    batch = pack([a, b], row_tokens=5)
    idx, covered = engine_routing(batch, 2, 2, required=True, experts=4)
    (ra, ca), (rb, cb) = batch.starts
    assert covered[ra, ca:ca + 4].all() and not covered[ra, ca + 4]  # the last token is never routed
    assert idx[ra, ca + 2, 1].tolist() == [0, 3] and covered[rb, cb] and not covered[rb, cb + 1:cb + 3].any()
    assert idx[rb, cb + 1, 0].tolist() == [0, 1]  # placeholders: distinct experts 0..k-1
    assert batch.pad_mask.sum() == batch.input_ids.numel() - 8


def test_engine_routing_refuses_what_it_cannot_replay():
    from rlx.errors import RLXError
    from rlx.train.moe import engine_routing
    from rlx.train.packing import pack
    from rlx.types import Sample

    def batch(routed):
        return pack([Sample([1, 2, 3], [4, 5], [1, 1], [0.0, 0.0], sample_id=7, routed_experts=routed)])

    assert engine_routing(batch(None), 2, 2, required=False, experts=4) is None
    with pytest.raises(RLXError, match="sample 7 carries no routed experts"):
        engine_routing(batch(None), 2, 2, required=True, experts=4)
    with pytest.raises(RLXError, match="expert 4 .* the model has 4 experts"):
        engine_routing(batch(_routed(4, value=4)), 2, 2, required=True, experts=4)
    with pytest.raises(RLXError, match="routed experts for 5 tokens, but it has 5"):
        engine_routing(batch(_routed(5)), 2, 2, required=True, experts=4)
    with pytest.raises(RLXError, match="not whole tokens of 3 layers x top-2"):
        engine_routing(batch(_routed(4)), 3, 2, required=True, experts=4)
