"""run.deterministic: two runs with one seed repeat each other bit for bit (metrics and exported weights), with two
engines sampling at temperature 1, whatever the ports, timing and which engine took which request; and a step replayed
from the checkpoint before it, on the batch the run saved (rollout.source: replay, no engines), repeats that step's
loss and update. The runs' prompts are a 3:1 mixture of a JSONL file and a folder `datasets` saved (data.mix), which
trains as any dataset does."""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlx.testing.processes import wait_gone
from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration

# what a run measures of the machine, not of the training: its clock, its cores, and the engines' health (on a loaded
# machine a probe can time out and an engine be taken out and back, its requests resent with their own seeds)
WALL_CLOCK = ("time/", "cores/", "engines/", "rollout/resent_requests")
STEPS = 3


def train(cfg: Path, hf: Path, *args: str) -> list[dict]:
    tag = uuid.uuid4().hex
    p = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf", str(hf), *args],
                       env={**os.environ, "RLX_TEST_TAG": tag}, capture_output=True, text=True, timeout=600)
    assert wait_gone(tag) == [], "rl train left processes behind"
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (cfg.parent / cfg.stem / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def config(folder: Path, name: str, **sections) -> Path:
    mix = [{"path": str(folder / "data.jsonl"), "weight": 3}, {"path": str(folder / "saved"), "weight": 1}]
    rollout = {"n_prompts": 3, "sampling": {"max_new_tokens": 8, "temperature": 1.0},
               "dynamic_sampling": {"filter_zero_variance": True}, "save_batches": True,
               "engines": [{"num_engines": 2, "server_args": {"num_threads": 1}}]}
    return small_run_config(folder, name, seed=5, run={"deterministic": True}, data={"path": None, "mix": mix},
                            rollout={**rollout, **sections.pop("rollout", {})},
                            train={"num_steps": STEPS, "checkpoint": {"interval": 1, "async_save": True},
                                   **sections.pop("train", {})},
                            ray={"cpus_per_engine": 0.5},
                            **sections)


@pytest.fixture(scope="module")
def two_runs(tiny_model_path, tmp_path_factory):
    import datasets

    from rlx.tasks import arithmetic

    tmp = tmp_path_factory.mktemp("deterministic")
    datasets.Dataset.from_list(arithmetic(20, seed=4)).save_to_disk(str(tmp / "saved"))
    return tmp, {name: (train(config(tmp, name), tmp / f"hf-{name}"), weights(tmp / f"hf-{name}")) for name in "ab"}


def test_two_deterministic_runs_with_two_engines_write_the_same_metrics_and_weights(two_runs):
    _, runs = two_runs
    (metrics_a, weights_a), (metrics_b, weights_b) = runs["a"], runs["b"]
    assert len(metrics_a) == STEPS and metrics_a == metrics_b
    assert 0 < metrics_a[-1]["reward/mean"] < 1 and metrics_a[0]["weight_version"] == 1  # it sampled, and trained
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def test_a_step_replayed_from_the_checkpoint_before_it_repeats_its_loss_and_update(two_runs):
    """The last step again, from run a's checkpoint of the step before, on the batch run a saved for it: the same
    training metrics and the same weights after it, with no engine started."""
    tmp, runs = two_runs
    (tmp / "replay" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp / "a" / "checkpoints" / f"step_{STEPS - 1}", tmp / "replay" / "checkpoints" / f"step_{STEPS - 1}")
    cfg = config(tmp, "replay", rollout={"source": "replay", "replay": str(tmp / "a" / "batches"), "save_batches": False})
    [replayed] = train(cfg, tmp / "hf-replay", "--resume")
    original = runs["a"][0][-1]
    generation = ("engines/", "rollout/groups_filtered", "rollout/pending_groups", "rollout/long_prompts_skipped",
                  "rollout/resent_requests", "weight_sync/")  # what only generating (and pushing to engines) measures
    assert replayed["weight_sync/bytes"] == 0  # (no engine to push to)
    assert ({k: v for k, v in replayed.items() if not k.startswith(generation)}
            == {k: v for k, v in original.items() if not k.startswith(generation)})
    assert replayed["step"] == STEPS and "loss" in replayed and "grad_norm" in replayed
    after = weights(tmp / "hf-replay")
    assert all(torch.equal(after[k], runs["a"][1][k]) for k in after)
    assert not list((tmp / "replay" / "logs").glob("engine-*.log"))


def test_async_mode_runs_one_step_off_and_repeats_itself_across_a_resume(tiny_model_path, tmp_path):
    """train.mode: async under run.deterministic: each batch generates whole while the step before trains, on the
    weights that step started from. A run stopped after step 2 (its checkpoint holds step 3's batch, generated
    already) and resumed writes what the run that went on wrote, bit for bit."""
    import datasets

    from rlx.tasks import arithmetic

    datasets.Dataset.from_list(arithmetic(20, seed=4)).save_to_disk(str(tmp_path / "saved"))
    whole = config(tmp_path, "whole", train={"mode": "async"})
    metrics = train(whole, tmp_path / "hf-whole")
    assert [r["async/staleness_max"] for r in metrics] == [0.0, 1.0, 1.0]  # step 1's batch: before any training
    resumed = config(tmp_path, "resumed", train={"mode": "async"})
    assert train(resumed, tmp_path / "hf-first", "--set", f"train.num_steps={STEPS - 1}") == metrics[:-1]
    saved = json.loads((tmp_path / "resumed" / "checkpoints" / f"step_{STEPS - 1}" / "rollout.json").read_text())
    assert saved["ahead"]["step"] == STEPS and saved["ahead"]["weight_version"] == STEPS - 2
    assert train(resumed, tmp_path / "hf-resumed", "--resume") == metrics
    a, b = weights(tmp_path / "hf-whole"), weights(tmp_path / "hf-resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
