"""The trainer's gradient reduction and parameter gather: what it skips."""

from types import SimpleNamespace as NS

from rlx.train.megatron_patches.ddp import skip_lone_collectives


def _ddp(size, scale=1.0, **cfg):
    """Two bucket groups (dense and expert) over a group of `size` ranks; which of megatron's calls stay."""
    group = NS(size=lambda: size)
    groups = [NS(intra_distributed_optimizer_instance_group=group, data_parallel_group=group,
                 buckets=[NS(gradient_scaling_factor=scale)], start_grad_sync="megatron's",
                 start_param_sync="megatron's") for _ in range(2)]
    config = dict(overlap_grad_reduce=False, overlap_param_gather=False, num_distributed_optimizer_instances=1,
                  check_for_nan_in_grad=False, check_for_large_grads=False, use_distributed_optimizer=True) | cfg
    d = NS(ddp_config=NS(**config), bucket_groups=groups[:1], expert_parallel_bucket_groups=groups[1:])
    skip_lone_collectives(d)
    return [(bg.start_grad_sync == "megatron's", bg.start_param_sync == "megatron's") for bg in groups]


def test_gradient_reduces_over_one_rank_are_skipped_and_no_others():
    """megatron reduce-scatters the gradient buffer even over a group of one rank (a copy of every gradient onto
    itself). Skipped exactly where the group has one rank and nothing is scaled; the DP=2 parity tests
    (test_parallel.py) compare the skipping one-process run against the reducing two-rank run."""
    assert [grad for grad, _ in _ddp(1)] == [False, False]  # both skipped
    assert [grad for grad, _ in _ddp(2)] == [True, True]
    assert [grad for grad, _ in _ddp(1, scale=0.5)] == [True, True]
    assert [grad for grad, _ in _ddp(1, overlap_grad_reduce=True)] == [True, True]
    assert [grad for grad, _ in _ddp(1, check_for_nan_in_grad=True)] == [True, True]


def test_parameter_gathers_over_one_rank_are_skipped_and_no_others():
    """After the optimizer step the distributed optimizer all-gathers each bucket's parameter shards; over one
    rank the shard is the whole buffer. Skipped there (its cost on CPU: test_megatron_cpu's OpenMP test), kept
    over two ranks, with the gather overlapped with the forward, and with several optimizer instances."""
    assert [param for _, param in _ddp(1)] == [False, False]
    assert [param for _, param in _ddp(1, scale=0.5)] == [False, False]  # a gather has nothing to scale
    assert [param for _, param in _ddp(2)] == [True, True]
    assert [param for _, param in _ddp(1, overlap_param_gather=True)] == [True, True]
    assert [param for _, param in _ddp(1, num_distributed_optimizer_instances=2)] == [True, True]
    # without the distributed optimizer there is no gather, only the gradient all-reduce (skipped over one rank)
    assert _ddp(1, use_distributed_optimizer=False) == [(False, True), (False, True)]
