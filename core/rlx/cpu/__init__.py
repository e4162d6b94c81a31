"""What exists for CPU speed, fenced here: how many CPU threads each trainer rank and engine uses and whether their
waiting threads sleep (`rlx.cpu.threads`), and how many cores each phase of a step used (`rlx.cpu.meter`). The
settings are the ``cpu`` config section. (The oneDNN matrix-product kernel is a ``matmul`` kernel plugin,
`rlx.builtins.matmul`, opt-in through ``model.kernels.matmul``.)

Ray gives an actor as many threads as CPUs it reserved (it sets ``OMP_NUM_THREADS``; one by default), so a
trainer rank on an 8-core machine would train on one core while the engine beside it idles. rlx sets the
threads itself:

- **sync mode**: rollout, training and weight sync take turns, so each phase runs alone on the machine. Each
  trainer rank gets its node's cores divided by the trainer ranks there (actor and critic), each engine its
  node's cores divided by the engines there.
- **async mode**: rollout and training run at once. ``cpu.async_cores`` says how they use the cores:
  - ``share`` (the default): each process gets the threads it would have in sync mode, and starts with
    ``OMP_WAIT_POLICY=PASSIVE`` (unless the environment sets a policy), so that an OpenMP thread that waits
    sleeps instead of spinning on a core the other phase could use. Whichever phase is busy gets the cores the
    other leaves idle. On 2 cores, SmolLM2-135M: 8.1-10.0 s/step against 10.9-11.5 s split 1 + 1
    (benchmarks/RESULTS.md, 2026-11-24). Without Ray the trainer runs in the driver's process, which started
    before the config was read: unless it was started with ``OMP_WAIT_POLICY=PASSIVE``, its threads spin, and
    it keeps ``ray.cpus_per_trainer`` threads instead (the engines still share).
  - ``split``: each process keeps what it reserved, ``ray.cpus_per_trainer`` and ``ray.cpus_per_engine``
    (at least one thread), which divide the machine. Better where ops are too small to use several threads
    (the tiny test model: 0.109 s/step against 0.123 shared), or where steady per-phase timings matter.
- An embedded engine of a model under a million parameters (a test model) decodes on one thread in either mode
  (`engine_threads`): its ops are too small to split, and a second thread spinning between them takes the core
  that the engine's HTTP thread and the driver need while it generates.
- ``cpu.threads`` (trainer ranks) and an engine group's ``server_args.num_threads`` override both.

One OpenMP team per process: a torch op large enough to run in parallel starts a team of threads on the thread
that calls it, and keeps it for that thread's life. With more OpenMP threads in a process than cores, libgomp
makes waiting threads sleep almost at once (its throttled spin), and every parallel op then waits for its threads
to wake: an elementwise op on 2 cores went from 75 to 115 us, the tiny model's train step from 37 to 50 ms. So
nothing but the thread that runs the model may run large torch ops: the matmul kernel's measurement runs on a
thread of its own that ends (`rlx.builtins.matmul`), and a trainer skips megatron's collectives over one rank,
which gloo would run on its own thread (`rlx.train.model.skip_lone_collectives`; a test counts the threads).

A node's cores are what Ray counts for it (``ray.num_cpus`` for a cluster started here), or this process's
CPU affinity without Ray.

Cores used per phase: the CPU seconds that the driver, the trainer ranks and the engines spent during the
phase, divided by its wall time (``cores/rollout``, ``cores/train``, ``cores/weight_sync``). Reward worker
processes are not counted. A step's first mark asks each process; when all run on the driver's machine, the
step's later marks read their CPU clocks from the kernel instead (each ask is a millisecond on the step's path).
"""
