"""run.deterministic: two runs with one seed repeat each other bit for bit (metrics and exported weights), with two
engines sampling at temperature 1, whatever the ports, timing and which engine took which request. Their prompts are a
3:1 mixture of a JSONL file and a folder `datasets` saved (data.mix), which trains as any dataset does."""

import json
import os
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

WALL_CLOCK = ("time/", "cores/")  # what a run measures of the machine, not of the training


def train(cfg: Path, hf: Path) -> list[dict]:
    tag = uuid.uuid4().hex
    p = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf", str(hf)],
                       env={**os.environ, "RLX_TEST_TAG": tag}, capture_output=True, text=True, timeout=600)
    assert wait_gone(tag) == [], "rl train left processes behind"
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (cfg.parent / cfg.stem / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_two_deterministic_runs_with_two_engines_write_the_same_metrics_and_weights(tiny_model_path, tmp_path):
    import datasets

    from rlx.tasks import arithmetic

    datasets.Dataset.from_list(arithmetic(20, seed=4)).save_to_disk(str(tmp_path / "saved"))
    mix = [{"path": str(tmp_path / "data.jsonl"), "weight": 3}, {"path": str(tmp_path / "saved"), "weight": 1}]
    runs = []
    for name in ("a", "b"):
        cfg = small_run_config(
            tmp_path, name, seed=5, run={"deterministic": True}, data={"path": None, "mix": mix},
            rollout={"n_prompts": 3, "sampling": {"max_new_tokens": 8, "temperature": 1.0},
                     "dynamic_sampling": {"filter_zero_variance": True},
                     "engines": [{"num_engines": 2, "server_args": {"num_threads": 1}}]},
            train={"num_steps": 3, "checkpoint": {"interval": 0}}, ray={"cpus_per_engine": 0.5})
        runs.append((train(cfg, tmp_path / f"hf-{name}"), weights(tmp_path / f"hf-{name}")))
    (metrics_a, weights_a), (metrics_b, weights_b) = runs
    assert len(metrics_a) == 3 and metrics_a == metrics_b
    assert 0 < metrics_a[-1]["reward/mean"] < 1 and metrics_a[0]["weight_version"] == 1  # it sampled, and trained
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
