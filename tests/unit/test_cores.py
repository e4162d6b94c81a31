"""Threads per process (sync and async shared: a phase has its node's cores; async split: what each reserved) and
cores used per phase."""

import asyncio

import pytest

from rlx.cpu.threads import plan_threads

from rlx.cpu.meter import CoreMeter


def test_sync_mode_gives_each_phase_its_nodes_cores():
    cores = {"a": 8, "b": 16}
    # node a: two trainer ranks and one engine; node b: one trainer rank and two engines
    plan = plan_threads("sync", cores, ["a", "a", "b"], ["a", "b", "b"], cpus_per_trainer=1, cpus_per_engine=1)
    assert plan.trainer == [4, 4, 16] and plan.engine == [8, 8, 8]
    assert plan_threads("sync", {"a": 1}, ["a", "a"], ["a"] * 3).trainer == [1, 1]  # never zero


def test_async_mode_split_keeps_the_reserved_cpus_and_the_config_overrides():
    plan = plan_threads("async", {"a": 8}, ["a", "a"], ["a"], cpus_per_trainer=3, cpus_per_engine=0.5,
                        async_cores="split")
    assert plan.trainer == [3, 3] and plan.engine == [1]
    assert plan_threads("sync", {"a": 8}, ["a"], ["a"], trainer_threads=2).trainer == [2]
    assert plan_threads("async", {"a": 8}, ["a"], [], trainer_threads=5, async_cores="split").trainer == [5]
    from rlx.cpu.threads import local_plan

    plan = local_plan("async", 2, cpus_per_trainer=3, cpus_per_engine=2, async_cores="split")  # without Ray: the same
    assert plan.trainer == [3] and plan.engine == [2, 2]


def test_async_mode_shared_gives_each_process_its_sync_threads():
    cores = {"a": 8, "b": 16}
    args = (cores, ["a", "a", "b"], ["a", "b", "b"])
    shared = plan_threads("async", *args, cpus_per_trainer=1, cpus_per_engine=1)  # share is the default
    assert shared == plan_threads("sync", *args) and shared.trainer == [4, 4, 16] and shared.engine == [8, 8, 8]
    assert plan_threads("async", *args, trainer_threads=3).trainer == [3, 3, 3]


def test_only_async_shared_processes_start_with_sleeping_waits(monkeypatch):
    from rlx.cpu.threads import process_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert process_env("async", "share") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert process_env("async", "split") == {} and process_env("sync", "share") == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own choice reaches the processes unchanged
    assert process_env("async", "share") == {"OMP_WAIT_POLICY": "ACTIVE"} and process_env("sync", "share") == {}


class _Client:
    def __init__(self, seconds):
        self.seconds = seconds

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def cpu_seconds(self):
        if isinstance(self.seconds, Exception):
            raise self.seconds
        return self.seconds


class _Engine:
    def __init__(self, url, seconds):
        self.url, self.seconds = url, seconds

    def client(self, timeout_s=None):
        return _Client(self.seconds)


def test_cores_per_phase_sum_every_process_over_the_phase():
    """Each interval: CPU seconds of the driver, trainer ranks and engines that reported at both ends, over the
    interval's wall time. A restarted engine (counter went back) and one that stops answering add nothing."""
    wall = iter([0.0, 2.0, 6.0])
    trainer = iter([[("h:1", 10.0), ("h:2", 20.0)], [("h:1", 10.5), ("h:2", 20.5)], [("h:1", 18.5), ("h:2", 28.5)]])
    engines = iter([[_Engine("e1", 100.0), _Engine("e2", 50.0)],
                    [_Engine("e1", 103.0), _Engine("e2", 51.0)],
                    [_Engine("e1", 3.0), _Engine("e2", RuntimeError("down"))]])
    driver = iter([("h:9", 1.0), ("h:9", 2.0), ("h:9", 2.0)])  # busy during the rollout only
    meter = CoreMeter(lambda: next(trainer), lambda: next(engines), clock=lambda: next(wall),
                      own_cpu=lambda: next(driver))

    async def run():
        for _ in range(3):
            await meter.mark()

    asyncio.run(run())
    got = meter.cores(["rollout", "train"])
    assert got["cores/rollout"] == pytest.approx((0.5 + 0.5 + 3.0 + 1.0 + 1.0) / 2.0)  # trainers, engines, driver
    assert got["cores/train"] == pytest.approx((8.0 + 8.0) / 4.0)
    assert meter.marks == []


def test_a_trainer_rank_in_the_drivers_process_counts_once():
    """Without Ray the trainer runs in the driver: the same process reported twice is one process."""
    wall = iter([0.0, 1.0])
    cpu = iter([5.0, 5.0, 6.5, 6.5])  # each mark reads it twice: as the driver and as the trainer rank
    me = "h:9"
    meter = CoreMeter(lambda: [(me, next(cpu))], lambda: [], clock=lambda: next(wall),
                      own_cpu=lambda: (me, next(cpu)))

    async def run():
        for _ in range(2):
            await meter.mark()

    asyncio.run(run())
    assert meter.cores(["train"]) == {"cores/train": pytest.approx(1.5)}


def test_later_marks_read_the_cpu_clocks_of_processes_beside_the_driver_instead_of_asking():
    """The first mark asks the trainer ranks and engines; when all run on this machine (same kernel and PID
    namespace), later marks read their CPU clocks from the kernel, which counts what they really used. A rank
    on another machine keeps every mark asking."""
    import subprocess
    import sys
    import time

    from rlx.cpu.meter import cpu_clock, process_identity

    spin = "import time\nwhile time.process_time() < 2: pass\ntime.sleep(30)"  # 2 s of CPU, then idle
    busy = subprocess.Popen([sys.executable, "-c", spin])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        asked = []

        def trainer():
            asked.append("trainer")
            return [(process_identity(busy.pid), 0.0)]

        class Engine(_Engine):
            def identity(self):
                return process_identity(idle.pid)

            def client(self, timeout_s=None):
                asked.append("engine")
                return _Client(0.0)

        meter = CoreMeter(trainer, lambda: [Engine("e1", 0.0)])
        spinner = cpu_clock(process_identity(busy.pid))
        deadline = time.monotonic() + 60
        while spinner() < 0.05:  # the spinner has started
            assert time.monotonic() < deadline
            time.sleep(0.01)
        seen = {}

        async def run():
            await meter.mark()
            seen["cpu"], seen["wall"] = spinner(), time.monotonic()
            while spinner() - seen["cpu"] < 0.3:  # the phase: until the spinner has used 0.3 s of CPU
                assert time.monotonic() < deadline
                time.sleep(0.01)
            seen["cpu"], seen["wall"] = spinner() - seen["cpu"], time.monotonic() - seen["wall"]
            await meter.mark()

        asyncio.run(run())
        assert asked == ["trainer", "engine"]  # once, at the first mark
        used = meter.cores(["train"])["cores/train"]
        # the spinner's share of a core over the phase, as the kernel counted it here (the marks' own instants
        # differ from these reads by the marks' calls: well under the 0.3 s of the phase); the first mark's zeros
        # are not counted
        assert abs(used - seen["cpu"] / seen["wall"]) < 0.2, (used, seen)

        assert cpu_clock(process_identity(busy.pid)) is not None and cpu_clock("h:1") is None
        elsewhere = CoreMeter(lambda: [("h:1@another-kernel/1", 1.0)], lambda: [])
        asyncio.run(elsewhere.mark())
        assert elsewhere.clocks is None
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()


def test_an_engine_of_a_model_too_small_to_split_its_ops_runs_on_one_thread(tmp_path):
    """Fewer than a million parameters (12 h^2 a layer, embedding and output layer): one thread, whatever the plan;
    a larger model the plan's threads; the group's own num_threads over both; a model whose config cannot be read
    the plan's."""
    import json

    from rlx.cpu.threads import SMALL_MODEL_PARAMETERS, approx_parameters, engine_threads

    def model(name, hidden, layers, vocab, tied):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"hidden_size": hidden, "num_hidden_layers": layers,
                                                   "vocab_size": vocab, "tie_word_embeddings": tied}))
        return str(d)

    tiny = model("tiny", 64, 2, 512, True)  # the built-in tiny model's shape
    small = model("small", 256, 4, 1000, False)
    assert approx_parameters(tiny) == 12 * 2 * 64 * 64 + 512 * 64 == 131_072
    assert approx_parameters(small) == 12 * 4 * 256 * 256 + 2 * 1000 * 256 > SMALL_MODEL_PARAMETERS
    assert engine_threads(2, tiny, {}) == 1 and engine_threads(2, small, {}) == 2
    assert engine_threads(2, tiny, {"num_threads": 2}) == 2 and engine_threads(1, small, {"num_threads": 4}) == 4
    assert approx_parameters(str(tmp_path / "nowhere")) is None and engine_threads(2, str(tmp_path / "nowhere"), {}) == 2
