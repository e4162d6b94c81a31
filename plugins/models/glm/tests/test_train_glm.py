"""`rl train` on the tiny GLM-4.5 with experts split over two trainer processes (EP=2, Ray) and rollout routing
replay: the embedded engine reports the experts it routed each token to, the trainer replays them (agreement 1),
every push (correction biases included) is verified tensor by tensor, and the exported HF folder loads."""

import os
import subprocess
import sys

import pytest

from rlx.orchestrate.metrics import read
from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration


def test_expert_parallel_run_with_routing_replay(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = small_run_config(tmp_path, "run", model={"path": "builtin://tiny-glm4-moe"},
                           ray={"cpus_per_trainer": 0.5, "cpus_per_engine": 0.5},
                           train={"num_steps": 3, "parallel": {"world_size": 2, "ep": 2},
                                  "objective": {"routing_replay": True}},
                           weight_sync={"verify": "full", "verify_full_interval": 1})
    run = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    rows = read(tmp_path / "run")
    assert len(rows) == 3 and all(r["moe/routing_agreement"] == 1.0 for r in rows)
    assert all(r["moe/natural_agreement"] > 0.99 for r in rows)  # same weights, same precision: little drift
    assert max(r["train_rollout_logprob_diff"] for r in rows) < 1e-4
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert model.model.layers[2].mlp.gate.e_score_correction_bias.abs().sum() > 0
