"""The agent example end to end: the official openai SDK as the harness, a calculator tool, the real
embedded engine, Megatron on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_calculator_agent_trains_through_the_openai_adapter(tiny_model_path, tmp_path, mode):
    """In async mode with a teacher too (on-policy distillation of multi-turn samples: the teacher scores each whole
    buffer, the KL counts the model's tokens)."""
    out = tmp_path / "agent"
    distill = ["--set", "rollout.teachers=[{name: calc, model_path: builtin://tiny-qwen3-arith}]", "--set",
               "train.objective.distill={coef: 0.1}"] if mode == "async" else []
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", "examples/agent.yaml", "--set",
                        "train.num_steps=2", "--set", f"run.output_dir={out}", "--set", f"train.mode={mode}",
                        *distill],
                       cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["samples"] >= 16 and row["rollout/failed"] == 0 and 0 <= row["reward/mean"] <= 2.5
        # the tool prompt alone is long: every sample carries the whole multi-turn buffer
        assert row["tokens"] / row["samples"] > 100
        if distill:
            assert row["distill/calc/reverse_kl"] > 0
