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
