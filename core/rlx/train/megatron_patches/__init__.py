"""Every change rlx makes to megatron-core's behaviour, in one place. Each is written against megatron-core 0.16.1
(the version the tests run and `scripts/gpu-bundle` ships), says why it exists, and is installed only where it
applies; the table names the tests that run through each (``test_each_fix_is_needed_and_works`` removes the
CPU fixes one at a time and sees each fail). A megatron-core upgrade starts here: drop what the new version fixed.

=============================  ==========================================  ===========================================
patch                          where it applies (installed by)             tests
=============================  ==========================================  ===========================================
`cpu.enable` (CUDA calls to    no CUDA: CPU trainers                       tests/integration/test_megatron_cpu.py,
CPU, streams, router gemm,     (`rlx.train.model.init_parallel`)           test_megatron_cpu_moe.py
split sizes, MLA without TE,                                               (``test_each_fix_is_needed_and_works``)
uneven gathers, no compile)
`jit.install` (``jit_fuser``   no CUDA; a 1.3 s import saved per trainer   test_megatron_cpu.py (``jit_fuser is a
a plain decorator)             process (``import rlx.train``)              plain decorator``)
`moe.expert_bias_with_padding` models with experts, any device: 0.16.1     plugins/models/glm/tests/test_parallel_glm.py
                               flattens the padding mask (`ModelRole`)
`moe.split_sequence_around_    experts under tensor parallelism without    plugins/models/*/tests/test_parallel_*.py
experts`                       sequence parallelism (`ModelRole`)          (tp > 1 vs one process)
`ddp.skip_lone_collectives`    a data-parallel group of one rank, any      tests/unit/test_grad_sync.py
                               device (`ModelRole.start_training`)
`checkpoint.step_kept_on_load` reshardable checkpoints with torch's Adam    tests/integration/test_reshard.py
                               (no Apex or TE): CPU (`ModelRole.load`)
=============================  ==========================================  ===========================================
"""
