"""megatron-core's DDP without the collectives a group of one rank makes (megatron-core 0.16.1; every version
that issues them; applied by `rlx.train.model.ModelRole.start_training`)."""

from __future__ import annotations

from typing import Any


def skip_lone_collectives(ddp: Any) -> None:  # megatron's DistributedDataParallel (untyped)
    """No gradient reduce-scatter and no parameter all-gather over a group of one rank. megatron issues both
    anyway: with one data-parallel rank each is a gloo/NCCL call copying a whole buffer onto itself (the
    reduce-scatter took 0.3 s a step for a 135M model on CPU).

    On CPU the gather also costs every later op: gloo copies on its own thread, and a large copy there starts a
    second OpenMP team; from then on this process runs more OpenMP threads than it has cores, and libgomp makes
    every waiting thread sleep almost at once, so each parallel op waits for its threads to wake (an elementwise
    op on 2 cores: 75 -> 115 us, for the life of the process).

    Each bucket group whose reduce group has one rank and whose gradients are not scaled (a scale of 1/dp = 1)
    keeps its gradients as they are; each whose gather group has one rank keeps its parameters (the shard is the
    whole buffer). Expert bucket groups are judged on their own group."""
    cfg = ddp.ddp_config
    for bg in [*ddp.bucket_groups, *ddp.expert_parallel_bucket_groups]:
        group = bg.intra_distributed_optimizer_instance_group if cfg.use_distributed_optimizer \
            else bg.data_parallel_group
        if group.size() != 1:
            continue
        if not (cfg.overlap_grad_reduce or cfg.num_distributed_optimizer_instances > 1 or cfg.check_for_nan_in_grad
                or cfg.check_for_large_grads) and all(b.gradient_scaling_factor == 1.0 for b in bg.buckets):
            bg.start_grad_sync = lambda force_all_reduce=False: None
        if cfg.use_distributed_optimizer and not cfg.overlap_param_gather \
                and cfg.num_distributed_optimizer_instances == 1:
            bg.start_param_sync = lambda force_sync=False: None
