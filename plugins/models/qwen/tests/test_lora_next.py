"""LoRA on Qwen3-Next's gated delta nets as `rl train` runs it (no Ray): the adapters on in_proj (q, k, v, z, beta and
a rows) and out_proj, and on the gated attention, pushed alone to the embedded engine, which serves them through
peft on transformers' in_proj_qkvz / in_proj_ba / out_proj as the trainer holds them. (TP=2 and peft's own load of
the adapters: test_parallel_next.py; checkpoints across layouts: tests/integration/test_reshard.py.)"""

import json
import subprocess
import sys

import pytest

from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration


def test_the_embedded_engine_serves_adapters_on_gated_delta_nets_as_the_trainer_holds_them(tmp_path):
    targets = ["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"]
    cfg = small_run_config(tmp_path, "run", model={"path": "builtin://tiny-qwen3-next"}, ray={"enabled": False},
                           train={"num_steps": 3, "optim": {"lr": 1e-2}, "objective": {"kl_coef": 0.01},
                                  "lora": {"rank": 8, "alpha": 16, "target_modules": targets}})
    p = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf", str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kl"] > 1e-3  # the adapters moved the policy
    assert rows[-1]["train_rollout_logprob_diff"] < 1e-4  # the engine serves what the trainer holds
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(targets)
