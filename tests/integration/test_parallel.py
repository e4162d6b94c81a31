"""Multi-process Megatron on CPU (gloo, under torchrun): TP=2, DP=2, PP=2 and their products train exactly
like one process: the same losses, entropy and updated weights, within 1e-5."""

import json
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

    tp, pp, world, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cfg = parse_config(json.dumps({
        "model": {"path": "builtin://tiny-qwen3"},
        "train": {"parallel": {"tp": tp, "pp": pp, "world_size": world}, "updates_per_step": 2,
                  "objective": {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_norm": "group"},
                  "max_tokens_per_micro_batch": 40,
                  # Adam divides by sqrt(v) + eps: with a tiny eps, a gradient element that is ~0 takes
                  # a full +-lr step whose sign is float noise. A moderate eps keeps the comparison of
                  # updated weights about the gradients rather than that noise.
                  "optim": {"lr": 1e-2, "adam_eps": 1e-4}}}))
    trainer = Trainer(cfg, build_plugins())
    g = torch.Generator().manual_seed(0)

    def sample(gid, sid, n):
        prompt = torch.randint(3, 500, (5,), generator=g).tolist()
        resp = torch.randint(3, 500, (n,), generator=g).tolist()
        return Sample(prompt, resp, [1] * (n - 1) + [0], [-6.2] * n, reward=float(sid % 3),
                      status=SampleStatus.COMPLETED, sample_id=sid, group_id=gid)

    sizes = [3, 2, 4, 1]  # a variable number of samples per prompt
    groups, sid = [], 0
    for gid, k in enumerate(sizes):
        groups.append(Group(gid, [sample(gid, sid + j, 4 + (sid + j) % 7) for j in range(k)]))
        sid += k
    m1 = trainer.train_step(RolloutBatch(1, groups))
    m2 = trainer.train_step(RolloutBatch(2, groups))
    # each pipeline stage's sender streams its own tensors; gather them all to rank 0 to compare
    mine = {k: v.flatten().tolist() for k, v in trainer.hf_tensors()} if trainer.par.sender else {}
    if trainer.par.dp_rank == 0 and not trainer.par.sender:
        for _ in trainer.hf_tensors():
            pass
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    if torch.distributed.get_rank() == 0:
        weights = {k: v for p in parts for k, v in p.items()}
        json.dump({"m1": m1, "m2": m2, "weights": weights}, open(out, "w"))
""")


def run(tmp_path, nproc, tp, pp=1):
    from rlx.rollout.engines.launch import free_port

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"out-{nproc}-{tp}-{pp}.json"
    def launch():
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                               f"--master-port={free_port()}", "--master-addr=127.0.0.1", str(script), str(tp),
                               str(pp), str(nproc), str(out)], capture_output=True, text=True, timeout=600,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})

    r = launch()
    if r.returncode != 0 and "SIGABRT" in r.stderr and "terminate called" in r.stderr:
        # Seen once in about thirty runs: a worker aborted inside gloo's C++ ("terminate called without an
        # active exception") a second after start. That is not a difference in the numbers, which this test
        # checks; run it once more, and say so.
        import warnings

        warnings.warn(f"tp={tp} pp={pp} nproc={nproc}: a worker aborted in C++; ran again", stacklevel=1)
        r = launch()
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tiny_model_path, tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), 1, 1)


@pytest.mark.parametrize("nproc,tp,pp", [(2, 2, 1), (2, 1, 1), (4, 2, 1), (2, 1, 2), (4, 1, 2), (4, 2, 2)],
                         ids=["tp2", "dp2", "tp2-dp2", "pp2", "pp2-dp2", "tp2-pp2"])
def test_parallel_matches_one_process(single, tmp_path, nproc, tp, pp):
    got = run(tmp_path, nproc, tp, pp)
    for step in ("m1", "m2"):
        for key in ("loss", "pg_loss", "entropy", "kl", "samples", "tokens"):
            assert got[step][key] == pytest.approx(single[step][key], abs=1e-5), (step, key)
    assert single["m2"]["kl"] > 0 and single["m1"]["loss"] != single["m2"]["loss"]  # the model did move
    worst = max(max(abs(a - b) for a, b in zip(got["weights"][n], w)) for n, w in single["weights"].items())
    assert worst < 1e-5, f"updated weights differ by up to {worst}"
