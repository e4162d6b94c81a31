"""`rl train` on the tiny Qwen3-MoE with experts split over two trainer processes (EP=2, Ray): every push
gathers the experts from both ranks into per-expert HF tensors that the embedded engine writes into its fused
expert weights, and every tensor the engine then serves is checked against what was sent (weight_sync.verify: full)."""

import os
import subprocess
import sys

import pytest

from rlx.orchestrate.metrics import read
from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration


def test_expert_parallel_run_pushes_every_expert_and_exports_hf(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = small_run_config(tmp_path, "run", model={"path": "builtin://tiny-qwen3-moe"},
                           ray={"cpus_per_trainer": 0.5, "cpus_per_engine": 0.5},
                           train={"num_steps": 3, "parallel": {"world_size": 2, "ep": 2}},
                           weight_sync={"verify": "full", "verify_full_interval": 1})
    run = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    rows = read(tmp_path / "run")
    assert len(rows) == 3 and all("moe/aux_loss" in r and "moe/load_max_mean" in r for r in rows)
    # the engine samples with the weights the trainer has: its log-probs are the trainer's (fp32, CPU)
    assert max(r["train_rollout_logprob_diff"] for r in rows) < 1e-4
    exported = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(str(f)))
    assert {n for n in exported if ".mlp.experts." in n and n.endswith("down_proj.weight")} == {
        f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight" for layer in range(2) for e in range(8)}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj[5],
                       exported["model.layers.1.mlp.experts.5.down_proj.weight"])


def test_int4_qat_quantises_the_experts_as_the_engine_does(tmp_path):
    """``rollout.quantization: int4`` with ``train.qat: int4`` on experts: the trainer fake-quantises each expert's
    fused gate/up and down projections (megatron's names) exactly where the engine holds the per-expert HF weights in
    INT4, so their log-probs agree as in full precision."""
    from rlx.testing.runs import train_and_export

    run = train_and_export(tmp_path, "builtin://tiny-qwen3-moe", 2, "rollout.quantization=int4", "train.qat=int4")
    assert all(r["train_rollout_logprob_diff"] < 1e-5 for r in run["rows"])
