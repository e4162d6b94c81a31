"""Evaluation during training (step 0 and every eval.interval steps, sync and async) and `rl eval` on the
checkpoint a run left, through the run's engines."""

import json
import os
import subprocess
import sys

import pytest

from rlx.tasks import arithmetic, write_jsonl
from rlx.testing.runs import read_events, small_run_config

pytestmark = pytest.mark.integration


def rl(*args):
    return subprocess.run([sys.executable, "-m", "rlx_cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def eval_section(tmp_path):
    path = write_jsonl(arithmetic(6, seed=99), tmp_path / "heldout.jsonl")
    return {"interval": 2, "datasets": [
        {"name": "exact", "path": str(path), "n_samples": 3, "rewards": ["exact_match"]},
        {"name": "digits", "path": str(path), "max_prompts": 4, "rewards": ["digits"]},
    ]}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_evaluation_at_step_0_and_every_interval_reaches_eval_jsonl_and_the_loggers(tiny_model_path, tmp_path, mode):
    """Sync in the driver's process, async through Ray (trainer rank and engine in Ray actors)."""
    cfg = small_run_config(tmp_path, "run", eval=eval_section(tmp_path), run={"loggers": ["tensorboard"]},
                           ray={"enabled": mode == "async", "num_cpus": 2},
                           train={"num_steps": 4, "mode": mode, "checkpoint": {"interval": 2}})
    r = rl("train", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    if mode == "async":  # cores shared: the Ray actors' processes start with sleeping waits (rlx.cpu)
        policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
        assert (f"CPU threads (async mode, cores shared): trainer ranks [2], engines [1]; "
                f"OMP_WAIT_POLICY: trainer ranks {policy}, engines {policy}") in r.stderr
        engine_log = (tmp_path / "run" / "logs" / "engine-default-0.log").read_text()
        # what the engine itself started with, and its matmul kernel (torch's own: the default)
        assert f"1 threads, OMP_WAIT_POLICY {policy}, matmul-torch)" in engine_log
    out = tmp_path / "run"
    rows = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["dataset"]) for r in rows] == [(s, d) for s in (0, 2, 4) for d in ("exact", "digits")]
    for row in rows:
        n = 6 if row["dataset"] == "exact" else 4
        assert row["n_prompts"] == n and row["failed"] == 0 and 0 <= row["reward_mean"] <= 1
        assert ("pass@3" in row) == (row["dataset"] == "exact") and 0 <= row["pass@1"] <= 1
        samples = (out / "eval_samples" / f"step_{row['step']}" / f"{row['dataset']}.jsonl").read_text().splitlines()
        assert len(samples) == n * (3 if row["dataset"] == "exact" else 1)
    for step in (0, 2, 4):
        assert f"rlx: eval at step {step}: exact pass@1" in r.stderr
    tags = {(v.tag, e.step) for e in read_events(out / "tensorboard") for v in e.summary.value}
    assert {("eval/exact/pass_at_3", s) for s in (0, 2, 4)} <= tags  # TensorBoard spells @ as _at_
    assert {("eval/digits/reward_mean", s) for s in (0, 2, 4)} <= tags


def test_rl_eval_on_a_runs_checkpoint_prints_a_table_and_appends_to_eval_jsonl(tiny_model_path, tmp_path):
    section = eval_section(tmp_path)
    cfg = small_run_config(tmp_path, "run", eval={**section, "interval": 0, "at_start": False},
                           ray={"enabled": False}, train={"num_steps": 2})
    r = rl("train", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    assert not (out / "eval.jsonl").exists()  # interval 0 and no step-0 evaluation: none during training
    r = rl("eval", cfg, "--checkpoint", out / "checkpoints" / "step_2")
    assert r.returncode == 0, r.stderr[-3000:]
    header, *lines = [ln for ln in r.stdout.splitlines() if ln and not ln.startswith("wrote")]
    assert header.split()[:3] == ["dataset", "pass@1", "pass@3"] and [ln.split()[0] for ln in lines] == ["exact", "digits"]
    assert "Warning" not in r.stderr and "warn" not in r.stderr  # the trainer's export noise went to its log
    rows = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["dataset"], r["checkpoint"]) for r in rows] == [
        (2, "exact", str(out / "checkpoints" / "step_2")), (2, "digits", str(out / "checkpoints" / "step_2"))]
    assert (out / "eval_hf" / "step_2" / "config.json").is_file()
    # an HF model folder directly, and clear errors
    r = rl("eval", cfg, "--checkpoint", out / "eval_hf" / "step_2")
    assert r.returncode == 0, r.stderr[-3000:]
    r = rl("eval", cfg, "--checkpoint", tmp_path)
    assert r.returncode != 0 and "neither an HF model folder" in r.stderr
    bare = small_run_config(tmp_path, "bare", ray={"enabled": False})
    r = rl("eval", bare)
    assert r.returncode != 0 and "eval.datasets: nothing to evaluate" in r.stderr
