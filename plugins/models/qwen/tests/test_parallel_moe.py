"""Qwen3-MoE under megatron on CPU (gloo, torchrun): tensor, expert and pipeline parallelism each train exactly like
one process (the same losses and updated weights within 1e-5), with the alltoall token dispatcher moving tokens
between expert-parallel ranks and the HF weights gathered from every rank that holds experts."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

WORKER = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.trainer import Trainer
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    tp, pp, ep, world, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    cfg = parse_config(json.dumps({
        "run": {"output_dir": out + ".run"}, "ray": {"enabled": False},
        "model": {"path": "builtin://tiny-qwen3-moe"},
        "train": {"parallel": {"tp": tp, "pp": pp, "ep": ep, "world_size": world}, "updates_per_step": 2,
                  "objective": {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_norm": "group"},
                  "max_tokens_per_micro_batch": 40, "optim": {"lr": 1e-2, "adam_eps": 1e-4}}}))
    g = torch.Generator().manual_seed(0)

    def sample(gid, sid, n):
        prompt = torch.randint(3, 500, (5,), generator=g).tolist()
        resp = torch.randint(3, 500, (n,), generator=g).tolist()
        return Sample(prompt, resp, [1] * (n - 1) + [0], [-6.2] * n, reward=float(sid % 3),
                      status=SampleStatus.COMPLETED, sample_id=sid, group_id=gid)

    groups, sid = [], 0
    for gid, k in enumerate([3, 2, 4, 1]):
        groups.append(Group(gid, [sample(gid, sid + j, 4 + (sid + j) % 7) for j in range(k)]))
        sid += k
    trainer = Trainer(cfg, build_plugins())
    m1 = trainer.train_step(RolloutBatch(1, groups))
    m2 = trainer.train_step(RolloutBatch(2, groups))
    mine = {}
    if trainer.par.gathers:
        named = {k: v.flatten().tolist() for k, v in trainer.hf_tensors()}
        mine = named if trainer.par.sender else {}
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    if torch.distributed.get_rank() == 0:
        json.dump({"m1": m1, "m2": m2, "weights": {k: v for p in parts for k, v in p.items()}}, open(out, "w"))
""")


def run(tmp_path, nproc, tp=1, pp=1, ep=1):
    from rlx.net import free_port

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"out-{nproc}-{tp}-{pp}-{ep}.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                        f"--master-port={free_port('127.0.0.1')}", "--master-addr=127.0.0.1", str(script), str(tp),
                        str(pp), str(ep), str(nproc), str(out)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), 1)


@pytest.mark.parametrize("nproc,tp,pp,ep", [(2, 2, 1, 1), (2, 1, 1, 2), (2, 1, 2, 1), (4, 2, 1, 2)],
                         ids=["tp2", "ep2", "pp2", "tp2-ep2"])
def test_parallel_matches_one_process(single, tmp_path, nproc, tp, pp, ep):
    got = run(tmp_path, nproc, tp, pp, ep)
    for step in ("m1", "m2"):
        for key in ("loss", "pg_loss", "entropy", "kl", "samples", "tokens"):
            assert got[step][key] == pytest.approx(single[step][key], abs=1e-5), (step, key)
    moe = sorted(k for k in single["m1"] if k.startswith("moe/"))
    assert moe == ["moe/aux_loss", "moe/layer0/load_max_mean", "moe/layer1/load_max_mean", "moe/load_max_mean",
                   "moe/tokens_dropped"]
    for key in moe:  # routing statistics count every token once, whatever the layout
        assert got["m1"][key] == pytest.approx(single["m1"][key], abs=1e-6), key
    assert single["m1"]["moe/aux_loss"] > 1 and single["m1"]["moe/tokens_dropped"] == 0
    assert single["m2"]["kl"] > 0 and single["m1"]["loss"] != single["m2"]["loss"]  # the model did move
    assert set(got["weights"]) == set(single["weights"])
    assert any(".mlp.experts.7.down_proj" in n for n in single["weights"])  # every expert, by its HF name
    worst = max(max(abs(a - b) for a, b in zip(got["weights"][n], w)) for n, w in single["weights"].items())
    assert worst < 1e-5, f"updated weights differ by up to {worst}"
