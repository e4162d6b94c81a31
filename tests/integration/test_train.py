"""`rl train` end to end on the tiny model: exact resume after kill -9, HF export, no stray processes."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from rlx.testing.processes import wait_gone
from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration

STEPS = 6


def write_config(tmp_path: Path, name: str) -> Path:
    return small_run_config(tmp_path, name, seed=7, rollout={"n_prompts": 3, "sampling": {"max_new_tokens": 4}},
                            train={"num_steps": STEPS, "checkpoint": {"interval": 1}})


def rl(*args, tag):
    env = {**os.environ, "RLX_TEST_TAG": tag}
    return subprocess.Popen([sys.executable, "-m", "rlx_cli.main", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_after_steps(p: subprocess.Popen, metrics: Path, steps: int, tag: str) -> None:
    """SIGKILL the driver once `metrics` has `steps` rows; its engines and workers must go with it."""
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert wait_gone(tag) == [], "engines outlived the killed driver"


def sample_order(run_dir: Path) -> list[tuple[int, list[int]]]:
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return [(r["step"], r["sample_ids"]) for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    tag = uuid.uuid4().hex
    p = rl("train", write_config(tmp, "run"), "--save-hf", tmp / "hf", tag=tag)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    # the terminal shows rlx's own lines only: Ray's go to the run's logs, which the first line names
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0] == (f"run: {tmp / 'run'} (run.output_dir, relative to the config's folder); logs (Ray, engines, "
                        f"trainers) in its logs/"), lines
    assert all(line.startswith(("run: ", "train ", "rlx: ")) for line in lines), lines
    assert "Connecting to existing Ray cluster" in (tmp / "run" / "logs" / "driver.log").read_text()
    assert wait_gone(tag) == [], "rl train left processes behind"
    return tmp


def test_metrics_have_every_required_key(uninterrupted):
    from rlx.orchestrate.metrics import REQUIRED, read

    rows = read(uninterrupted / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert set(REQUIRED) <= set(r)
        assert r["samples"] == 6 and r["tokens"] > 0 and r["time/step_s"] >= r["time/train_s"]


def test_ppo_with_a_critic_in_processes_of_its_own_kill_9_during_a_save_then_resume(uninterrupted, tmp_path):
    """kill -9 of the driver while a random step's checkpoint is being written (train.checkpoint.async_save: the
    ranks train on meanwhile), then --resume: from the checkpoint before, the same sample ids, in the same order,
    as an uninterrupted run. With PPO and the critic in Ray processes of its own, on bundles of its own, so the
    critic's processes must go with the driver, and --resume restores the actor and the critic. (GRPO's resume
    is this one without the critic: the data order and the actor's state are the same code.)"""
    want = sample_order(uninterrupted / "run")  # sample ids do not depend on the objective
    assert len(want) == STEPS and len({i for _, ids in want for i in ids}) == STEPS * 6
    cfg = write_config(tmp_path, "ppo")
    sets = ["--set", "train.objective.advantage=gae", "--set", "train.critic.parallel.world_size=1",
            "--set", "train.critic.placement=own",  # bundles of its own (test_parallel covers shared ones)
            "--set", "train.checkpoint.async_save=true",
            "--set", "ray.cpus_per_trainer=0.5", "--set", "ray.cpus_per_engine=0.5"]
    kill_at = random.Random().randint(2, STEPS - 2)
    tag = uuid.uuid4().hex
    p = rl("train", cfg, *sets, tag=tag)
    ckpt = tmp_path / "ppo" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (ckpt / f".step_{kill_at}.tmp").exists():  # being written: the step after it may have started
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert wait_gone(tag) == [], "engines or trainers outlived the killed driver"  # the critic's processes too
    assert not (ckpt / f"step_{kill_at}").exists(), "the kill came after the save, not during it"
    from rlx.orchestrate.checkpoint import newest

    before = newest(ckpt)  # what --resume takes
    assert before is not None and before.name == f"step_{kill_at - 1}"
    assert (before / "critic" / "scheduler.pt").exists()

    p = rl("train", cfg, *sets, "--resume", tag=tag)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert sample_order(tmp_path / "ppo") == want, f"killed after step {kill_at}"
    rows = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["critic/value_loss"] > 0 and r["critic/lr"] > 0 for r in rows)
    assert wait_gone(tag) == [], "rl train left processes behind"


def test_resume_of_a_finished_run_says_so_and_starts_nothing(uninterrupted):
    driver_log = (uninterrupted / "run" / "logs" / "driver.log").read_text()
    p = rl("train", uninterrupted / "run.yaml", "--resume", tag=uuid.uuid4().hex)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert (f"rlx: nothing to resume: {uninterrupted / 'run'} finished, its newest checkpoint is step {STEPS} of "
            f"train.num_steps {STEPS}") in err
    assert out.startswith(f"done: {STEPS} steps in {uninterrupted / 'run'}.")
    assert (uninterrupted / "run" / "logs" / "driver.log").read_text() == driver_log  # no Ray, no engines


def test_resume_without_a_checkpoint_is_a_clear_error(tiny_model_path, tmp_path):
    p = rl("train", write_config(tmp_path, "fresh"), "--resume", tag=uuid.uuid4().hex)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 1 and "no complete checkpoint under" in err and "Traceback" not in err


def test_save_hf_exports_what_transformers_loads(uninterrupted, tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = AutoModelForCausalLM.from_pretrained(uninterrupted / "hf", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    AutoTokenizer.from_pretrained(uninterrupted / "hf")
    diffs = [(a - b).abs().max().item() for a, b in zip(trained.parameters(), initial.parameters())]
    assert max(diffs) > 1e-4  # it trained
    ids = torch.tensor([[1, 264, 263, 201]])
    assert torch.isfinite(trained(ids).logits).all()


def test_pipeline_parallel_run_trains_checkpoints_and_resumes_in_one_process(tiny_model_path, tmp_path):
    """Two Ray trainer ranks as two pipeline stages: train (engines offloaded meanwhile), push weights,
    checkpoint; then resume that checkpoint with one trainer rank (a layout-independent checkpoint)."""
    cfg = write_config(tmp_path, "pp")
    sets = ["--set", "train.parallel.world_size=2", "--set", "train.parallel.pp=2",
            "--set", "train.checkpoint.interval=0",
            "--set", "ray.cpus_per_trainer=0.5", "--set", "ray.cpus_per_engine=0.5",  # this machine has 2 cores
            "--set", "rollout.offload_during_train=true"]  # engines release memory while trainers step
    tag = uuid.uuid4().hex
    p = rl("train", cfg, *sets, "--set", "train.num_steps=2", tag=tag)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    ckpt = tmp_path / "pp" / "checkpoints" / "step_2"
    assert (ckpt / "actor" / "metadata.json").exists()  # megatron's torch_dist
    one = [s.replace("world_size=2", "world_size=1").replace("pp=2", "pp=1") for s in sets]
    p = rl("train", cfg, *one, "--set", "train.num_steps=3", "--resume", tag=tag)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert [step for step, _ in sample_order(tmp_path / "pp")] == [1, 2, 3]
    assert wait_gone(tag) == [], "rl train left processes behind"


def test_a_run_bigger_than_the_cluster_it_starts_fails_at_once(tiny_model_path, tmp_path):
    p = rl("train", write_config(tmp_path, "big"), "--set", "ray.cpus_per_trainer=64", tag=uuid.uuid4().hex)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 1 and "needs 65 CPU" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "big" / "logs" / "ray-head.log").exists(), "known before a Ray head was started"


def test_async_kill_9_then_resume_loses_and_repeats_no_sample(tiny_model_path, tmp_path):
    """Async mode: queued groups and in-flight partial rollouts saved at the last checkpoint are trained
    after the resume; no sample id is trained twice."""
    steps = 8
    cfg = write_config(tmp_path, "async")
    sets = ["--set", "train.mode=async", "--set", f"train.num_steps={steps}", "--set", "ray.enabled=false"]
    kill_at = random.Random().randint(2, steps - 3)
    tag = uuid.uuid4().hex
    p = rl("train", cfg, *sets, tag=tag)
    metrics = tmp_path / "async" / "metrics.jsonl"
    kill_after_steps(p, metrics, kill_at, tag)
    ckpt = tmp_path / "async" / "checkpoints"
    from rlx.orchestrate.checkpoint import newest

    folder = newest(ckpt)  # what --resume takes
    saved_at = json.loads((folder / "meta.json").read_text())["step"]
    state = json.loads((folder / "rollout.json").read_text())
    saved = {s["sample_id"] for g in state["queued"] + state["pending"] for s in g["samples"]}

    p = rl("train", cfg, *sets, "--resume", tag=tag)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    order = sample_order(tmp_path / "async")
    assert [step for step, _ in order] == list(range(1, steps + 1))
    ids = [i for _, step_ids in order for i in step_ids]
    assert len(ids) == len(set(ids)) == steps * 6, f"killed after step {kill_at}: a sample trained twice"
    after = {i for step, step_ids in order if step > saved_at for i in step_ids}
    assert saved <= after, f"saved at step {saved_at}, lost {sorted(saved - after)}"
    assert wait_gone(tag) == []
