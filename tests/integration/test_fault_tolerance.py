"""`rl train` with two engines behind sglang-router, one of them killed (SIGKILL) or frozen (SIGSTOP) during
the run: the run completes every step, trains every sample id exactly once, and its metrics show the engine
taken out, restarted and back."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlx.testing.processes import environ, tagged_pids, wait_gone
from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration

# a step takes ~0.2 s here; a frozen engine is out after ~6 s of failed probes and back ~10 s after its restart, longer
# on a loaded machine (60 steps once ended before it rejoined, in a full suite run): the engine must come back before
# the end
STEPS = 100


def engine_pids(tag: str) -> list[int]:
    return tagged_pids(tag, b"rlx.rollout.engines.embedded")


def run_with_a_fault(tmp_path: Path, name: str, sig: int, *sets: str) -> tuple[str, list[dict]]:
    cfg = small_run_config(
        tmp_path, name, seed=5,
        rollout={"n_prompts": 3, "sampling": {"max_new_tokens": 48, "ignore_eos": True},
                 "engines": [{"num_engines": 2, "server_args": {"num_threads": 1}}],
                 "router": {"policy": "round_robin"},
                 "fault_tolerance": {"probe_interval_s": 0.5, "probe_timeout_s": 2, "failures": 2}},
        train={"num_steps": STEPS, "checkpoint": {"interval": 0}})
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"RLX_TEST_TAG": tag}
    p = subprocess.Popen([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), *sets], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / name / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):  # step 1 done: step 2's rollout runs
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()[-3000:]
            time.sleep(0.05)
        pids = engine_pids(tag)
        assert len(pids) == 2, pids
        policies = {environ(pid).get("OMP_WAIT_POLICY") for pid in pids}
        os.kill(pids[0], sig)
        while True:  # the engine started in its place
            assert p.poll() is None and time.monotonic() < deadline + 300, "no engine took the stopped one's place"
            new = [pid for pid in engine_pids(tag) if pid not in pids]
            if new:
                try:
                    policies.add(environ(new[0]).get("OMP_WAIT_POLICY"))
                    break
                except OSError:  # gone between the two reads: look again
                    pass
            time.sleep(0.05)
        _, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err[-3000:]
    assert wait_gone(tag) == [], "rl train left processes behind"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    # async mode shares the cores: its engines, the restarted one too, start with sleeping waits (rlx.cpu);
    # sync mode leaves them be
    assert policies == {"PASSIVE" if "train.mode=async" in sets else None}, policies
    return err, rows


def assert_every_sample_once(run_dir: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ids = [i for r in rows for i in r["sample_ids"]]
    assert len(ids) == len(set(ids)) == STEPS * 6


def test_sync_run_with_ray_survives_a_killed_engine(tiny_model_path, tmp_path):
    err, rows = run_with_a_fault(tmp_path, "sync", signal.SIGKILL,
                                 "--set", "ray.cpus_per_trainer=0.5", "--set", "ray.cpus_per_engine=0.5")
    assert_every_sample_once(tmp_path / "sync")
    last = rows[-1]
    assert last["engines/taken_out"] == 1 and last["engines/restarts"] == 1 and last["engines/rejoined"] == 1, last
    assert last["engines/serving"] == 2
    assert "taken out: its process exited" in err and "serves again" in err
    assert "Traceback" not in err


def test_async_run_survives_a_frozen_engine(tiny_model_path, tmp_path):
    """With LoRA adapter pushes too: the engine started in the frozen one's place gets the adapter requests name,
    requests sent again name the adapter served then, and older adapters are unloaded as they fall out of use."""
    err, rows = run_with_a_fault(tmp_path, "async", signal.SIGSTOP, "--set", "train.mode=async",
                                 "--set", "ray.enabled=false", "--set", "train.lora.rank=4")
    assert_every_sample_once(tmp_path / "async")
    last = rows[-1]
    assert last["engines/taken_out"] == 1 and last["engines/restarts"] == 1 and last["engines/rejoined"] == 1, last
    assert "health probe(s) in a row failed" in err and "serves again" in err
    assert "Traceback" not in err and "unloading LoRA adapter" not in err  # (every unload found its adapter)
    # the adapters alone (rank 4, peft's layout: 9,728 floats), or nothing while every engine was out
    assert {r["weight_sync/bytes"] for r in rows} <= {0.0, 38912.0}
    # without Ray the trainer is the driver's process, started without sleeping waits: it keeps its one thread
    assert ("CPU threads (async mode, cores shared): trainer ranks [1], engines [1, 1]; OMP_WAIT_POLICY: trainer "
            "ranks unset, engines PASSIVE; the trainer runs in this process") in err


def start_run(tmp_path: Path, name: str, steps: int, *sets: str, tag: str) -> tuple[subprocess.Popen, Path]:
    cfg = small_run_config(tmp_path, name, seed=5, rollout={"n_prompts": 3, "sampling": {"max_new_tokens": 24}},
                           train={"num_steps": steps, "checkpoint": {"interval": 0}})
    p = subprocess.Popen([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--set", "ray.enabled=false",
                          *sets], env={**os.environ, "RLX_TEST_TAG": tag}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    return p, cfg


def wait_rows(p: subprocess.Popen, metrics: Path, n: int) -> None:
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()[-3000:]
        time.sleep(0.05)


def test_sigterm_saves_a_checkpoint_at_the_end_of_the_step_and_resume_goes_on(tiny_model_path, tmp_path):
    """No periodic checkpoints: SIGTERM after step 2 saves the step it stops after, exits 143 with one line,
    and --resume trains the remaining steps: every sample id once."""
    steps, tag = 20, uuid.uuid4().hex  # SIGTERM lands after step 2, with ~18 steps (~4 s) to spare
    p, cfg = start_run(tmp_path, "term", steps, tag=tag)
    metrics = tmp_path / "term" / "metrics.jsonl"
    wait_rows(p, metrics, 2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err[-3000:]
    done = len(metrics.read_text().splitlines())
    assert done < steps
    assert f"rlx: stopped by SIGTERM after step {done}; checkpoint step_{done} saved" in err, err[-2000:]
    assert "Traceback" not in err and wait_gone(tag) == []
    p = subprocess.Popen([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--set", "ray.enabled=false",
                          "--resume"], env={**os.environ, "RLX_TEST_TAG": tag}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "term" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    ids = [i for r in rows for i in r["sample_ids"]]
    assert len(ids) == len(set(ids)) == steps * 6


def test_a_second_ctrl_c_stops_at_once(tiny_model_path, tmp_path):
    tag = uuid.uuid4().hex
    # Steps of seconds (long rollouts): both signals land inside one step. With the steps of a few tens of ms the
    # tiny model now takes, the first Ctrl-C's end-of-step checkpoint could finish before the second was handled.
    p, _ = start_run(tmp_path, "int", 400, "--set", "train.checkpoint.interval=0",
                     "--set", "rollout.sampling.max_new_tokens=1000", "--set", "rollout.sampling.ignore_eos=true",
                     tag=tag)
    wait_rows(p, tmp_path / "int" / "metrics.jsonl", 1)
    p.send_signal(signal.SIGINT)
    seen = []  # the second Ctrl-C once the first is acknowledged, as a user presses it
    for line in p.stderr:
        seen.append(line)
        if "stopping at the end of this step" in line:
            break
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, rest = p.communicate(timeout=120)
    err = "".join(seen) + rest
    assert p.returncode == 130, err[-3000:]
    assert "rlx: stopped at once by a second Ctrl-C" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "int" / "checkpoints").exists() or not any((tmp_path / "int" / "checkpoints").iterdir())
    assert time.monotonic() - t0 < 30
    assert wait_gone(tag) == []


NAN_WORKER = """
import json, math, sys, warnings
warnings.filterwarnings("ignore")
from rlx.config import parse_config
from rlx.errors import RLXError
from rlx.orchestrate.ranks import LocalTrainerGroup
from rlx.types import Group, RolloutBatch, Sample, SampleStatus

cfg = parse_config(json.dumps({"model": {"path": "builtin://tiny-qwen3"}, "ray": {"enabled": False}}))
group = LocalTrainerGroup(cfg)
trainer = group.worker.trainer
before = {k: v.clone() for k, v in trainer.hf_tensors()}
def sample(sid, reward):
    return Sample([5, 6, 7], [8, 9, 10], [1, 1, 1], [-2.0] * 3, reward=reward, status=SampleStatus.COMPLETED,
                  sample_id=sid, group_id=0)
try:
    group.train_step(RolloutBatch(1, [Group(0, [sample(0, 1.0), sample(1, float("nan"))])]))
    print("TRAINED")
except RLXError as e:
    print("ERROR", e)
after = dict(trainer.hf_tensors())
print("UNCHANGED", all((before[k] == after[k]).all().item() for k in before))
"""


def test_a_nan_loss_stops_the_step_before_the_optimizer_and_says_so(tiny_model_path, tmp_path):
    script = tmp_path / "w.py"
    script.write_text(NAN_WORKER)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "ERROR the loss is not finite (NaN or inf) in update 1 of 1 of this step" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "UNCHANGED True" in r.stdout


def trainer_pids(tag: str) -> list[int]:
    return tagged_pids(tag, b"TrainerWorker")


def test_a_killed_trainer_rank_is_restarted_from_the_last_checkpoint_then_ends_the_run_in_one_line(
        tiny_model_path, tmp_path):
    """train.max_restarts 1: the trainer actor killed after step 3 (checkpoint at step 2): the run starts its
    trainers again from the newest checkpoint and trains on. Killed again, restarts are used up: the run
    ends with one line naming the rank, without Ray's traceback or its 30 s shutdown drain."""
    cfg = small_run_config(tmp_path, "restart", seed=5, rollout={"n_prompts": 3, "sampling": {"max_new_tokens": 24}},
                           train={"num_steps": 400, "max_restarts": 1, "checkpoint": {"interval": 2}})
    tag = uuid.uuid4().hex
    p = subprocess.Popen([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--set", "ray.cpus_per_trainer=0.5",
                          "--set", "ray.cpus_per_engine=0.5"], env={**os.environ, "RLX_TEST_TAG": tag},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "restart" / "metrics.jsonl"
    try:
        wait_rows(p, metrics, 3)
        first = trainer_pids(tag)
        assert len(first) == 1, first
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 300
        while not ((second := [x for x in trainer_pids(tag) if x != first[0]]) and metrics.exists() and
                   any(json.loads(line).get("trainer/restarts") == 1 for line in metrics.read_text().splitlines())):
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()[-3000:]
            time.sleep(0.1)
        os.kill(second[0], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1, err[-3000:]
    assert "rlx: restarting the trainers (1 of train.max_restarts 1)" in err
    went_on = [int(x.split("going on at step ")[1]) for x in err.splitlines() if "going on at step" in x]
    assert len(went_on) == 1 and went_on[0] % 2 == 1, err[-2000:]  # after the newest checkpoint (even steps)
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and f"trainer rank 0 (pid {second[0]} on 127.0.0.1) died during" in line[0], err[-3000:]
    assert "Traceback" not in err and "ActorDiedError" not in err
    assert took < 20, f"{took:.0f}s from the rank's death to the end of rl train"  # Ray drains 30 s otherwise
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(rows) + 1)) and rows[-1]["trainer/restarts"] == 1
    order = [json.loads(line) for line in (tmp_path / "restart" / "samples.jsonl").read_text().splitlines()]
    ids = [i for r in order for i in r["sample_ids"]]
    assert len(ids) == len(set(ids)) == len(rows) * 6  # the steps trained again took the same samples, once
    assert wait_gone(tag) == []
