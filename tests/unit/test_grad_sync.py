"""The trainer's gradient reduction: what it skips."""


def test_gradient_reduces_over_one_rank_are_skipped_and_no_others():
    """megatron reduce-scatters the gradient buffer even over a group of one rank (a copy of every gradient onto
    itself). Skipped exactly where the group has one rank and nothing is scaled; the DP=2 parity tests
    (test_parallel.py) compare the skipping one-process run against the reducing two-rank run."""
    from types import SimpleNamespace as NS

    from rlx.train.model import skip_lone_grad_reduces

    def ddp(size, scale=1.0, **cfg):
        group = NS(size=lambda: size)
        groups = [NS(intra_distributed_optimizer_instance_group=group, buckets=[NS(gradient_scaling_factor=scale)],
                     start_grad_sync="megatron's") for _ in range(2)]
        config = dict(overlap_grad_reduce=False, num_distributed_optimizer_instances=1, check_for_nan_in_grad=False,
                      check_for_large_grads=False, use_distributed_optimizer=True) | cfg
        d = NS(ddp_config=NS(**config), bucket_groups=groups[:1], expert_parallel_bucket_groups=groups[1:])
        skip_lone_grad_reduces(d)
        return [bg.start_grad_sync == "megatron's" for bg in groups]

    assert ddp(1) == [False, False]  # both skipped
    assert ddp(2) == [True, True]
    assert ddp(1, scale=0.5) == [True, True]
    assert ddp(1, overlap_grad_reduce=True) == [True, True]
    assert ddp(1, check_for_nan_in_grad=True) == [True, True]
