"""Colocated offload (`rlx.train.offload`): the schedule (which model is resident when) through a PPO step with a
critic and a reference model, a weight push and a checkpoint; and the mechanism itself, run on the CPU by moving
host memory to host memory: while the engines would generate, the trainer holds no parameter, gradient or
optimizer storage, and training with offload is bit for bit training without it. (The GPU check measures the
peak memory it saves: scripts/gpu-check.)"""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""
    import json, sys, tempfile, warnings
    from pathlib import Path
    warnings.filterwarnings("ignore")
    import torch
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.offload import Residency
    from rlx.train.trainer import Trainer
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    offload, advantage = sys.argv[1] == "on", sys.argv[2]
    lora = {"lora": {"rank": 4}} if sys.argv[4:] == ["lora"] else {}
    cfg = parse_config(json.dumps({"model": {"path": "builtin://tiny-qwen3"}, "train": {
        "offload": offload, "objective": {"advantage": advantage, "kl_coef": 0.1}, "optim": {"lr": 1e-3}, **lora}}))
    if sys.argv[3] == "move":
        Residency.MOVES = ("cuda", "cpu")  # on a CPU: host memory to host memory, through the GPU's code path
    trainer = Trainer(cfg, build_plugins())

    def held_bytes():
        roles = [r for r in (trainer.actor, trainer.reference, trainer.critic) if hasattr(r, "model")]  # (LoRA's
        # reference is the actor with its adapters off)
        stores = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                  for r in roles for t in [*r.model.parameters(), *(b.grad_data for b in (r.ddp.buffers if r.ddp else []))]}
        for r in roles:
            for inner in (r._inner_optimizers() if r.optimizer else []):
                for st in inner.state.values():
                    stores.update({v.untyped_storage()._cdata: v.untyped_storage().nbytes() for v in st.values()
                                   if isinstance(v, torch.Tensor) and v.dim()})
        return sum(stores.values())

    g = torch.Generator().manual_seed(0)
    out = {"held_at_start": held_bytes(), "steps": [], "held_between": []}
    for step in (1, 2):
        groups = [Group(i, [Sample(torch.randint(3, 500, (5,), generator=g).tolist(),
                                   torch.randint(3, 500, (n,), generator=g).tolist(), [1] * n, [-6.0] * n,
                                   reward=float(j % 2), status=SampleStatus.COMPLETED, sample_id=4 * i + j, group_id=i)
                            for j, n in enumerate([3, 6, 1, 4])]) for i in range(2)]
        m = trainer.train_step(RolloutBatch(step, groups))
        out["steps"].append({k: v for k, v in m.items() if isinstance(v, float) and "time" not in k})
        out["held_between"].append(held_bytes())
        out["pushed"] = [float(t.double().sum()) for _, t in trainer.hf_tensors()]
    with tempfile.TemporaryDirectory() as d:
        trainer.save(Path(d))
    out["held_at_end"] = held_bytes()
    out["history"] = list(trainer.memory.history)
    print(json.dumps(out))
""")


def run(tmp_path, offload: str, advantage: str, move: str = "move", *more: str) -> dict:
    script = tmp_path / "offload.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), offload, advantage, move, *more], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_ppo_schedule_and_offload_changes_nothing_but_memory(tiny_model_path, tmp_path):
    on, _ = run(tmp_path, "on", "gae")
    off, _ = run(tmp_path, "off", "gae")
    actor = {"actor": "all", "reference": "weights"}
    step = [{"critic": "all"}, {"critic": "all"}, actor, {}]  # values, the critic's update, the actor's, generation
    push = [{"actor": "weights"}, {}]
    save = [{"actor": "all"}, {"critic": "all"}, {}]
    assert on["history"] == [{}] + step + push + step + push + save
    assert off["history"] == []  # offload off: nothing is ever moved or scheduled
    # between steps (the engines' turn) the trainer holds no storage at all; without offload, all of it
    assert on["held_at_start"] == on["held_between"][0] == on["held_between"][1] == on["held_at_end"] == 0
    assert min(off["held_between"]) > 2**20
    assert on["steps"] == off["steps"] and on["pushed"] == off["pushed"]


def test_grpo_schedule_on_a_cpu_moves_nothing_and_says_so(tiny_model_path, tmp_path):
    on, stderr = run(tmp_path, "on", "grpo", "stay")
    assert "the trainer runs on the CPU" in stderr
    actor = {"actor": "all", "reference": "weights"}
    assert on["history"] == [{}, actor, {}, {"actor": "weights"}, {}, actor, {}, {"actor": "weights"}, {}] + [
        {"actor": "all"}, {}]
    assert on["held_between"][0] == on["held_between"][1] > 2**20


def test_lora_offload_moves_the_frozen_weights_too(tiny_model_path, tmp_path):
    """With LoRA (`rlx.train.lora`) megatron's buffers hold the adapters only: the frozen model goes too, and the
    run is the same as without offload."""
    on, _ = run(tmp_path, "on", "grpo", "move", "lora")
    off, _ = run(tmp_path, "off", "grpo", "move", "lora")
    # without offload the actor stays (514 KiB of weights, its adapters and their Adam state): one model, no reference
    # copy beside it (LoRA's reference is the actor with its adapters off)
    assert on["held_between"] == [0, 0] and 2**19 < min(off["held_between"]) < 2**20
    assert on["steps"] == off["steps"] and on["pushed"] == off["pushed"]

