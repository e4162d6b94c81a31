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
    replay = sys.argv[6] if len(sys.argv) > 6 else "none"  # none, off (engine routing, no replay), on
    cfg = parse_config(json.dumps({
        "run": {"output_dir": out + ".run"}, "ray": {"enabled": False},
        "model": {"path": "builtin://tiny-qwen3-moe"},
        "train": {"parallel": {"tp": tp, "pp": pp, "ep": ep, "world_size": world}, "updates_per_step": 2,
                  "objective": {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_norm": "group",
                                "routing_replay": replay == "on"},
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
    if replay != "none":  # an engine whose routers differ from the trainer's: its routing and log-probs
        import base64
        from transformers import AutoModelForCausalLM
        from rlx.models.tiny import resolve_model_path
        engine = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin://tiny-qwen3-moe"),
                                                      dtype=torch.float32).eval()
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in engine.model.layers:
                w = layer.mlp.gate.weight
                w.add_(torch.randn(w.shape, generator=noise) * w.std() * 0.25)
            for group in groups:
                for s in group.samples:
                    full = s.prompt_ids + s.response_ids
                    o = engine(torch.tensor([full[:-1]]), output_router_logits=True)
                    top = torch.stack([torch.topk(lg, 2, -1).indices for lg in o.router_logits], 1)  # [T-1, L, k]
                    s.routed_experts = base64.b64encode(top.to(torch.int32).numpy().tobytes()).decode()
                    lp = torch.log_softmax(o.logits[0].float(), -1)
                    p0 = len(s.prompt_ids) - 1
                    s.rollout_logprobs = [lp[p0 + j, t].item() for j, t in enumerate(s.response_ids)]
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


def run(tmp_path, nproc, tp=1, pp=1, ep=1, replay="none"):
    from rlx.net import free_port

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"out-{nproc}-{tp}-{pp}-{ep}-{replay}.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                        f"--master-port={free_port('127.0.0.1')}", "--master-addr=127.0.0.1", str(script), str(tp),
                        str(pp), str(ep), str(nproc), str(out), replay],
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


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("r3")
    return run(folder, 1, replay="off"), run(folder, 1, replay="on")


def test_routing_replay_makes_the_trainer_route_as_the_engine_did(replayed):
    """An engine whose routers were perturbed: without replay the trainer picks other experts for part of the
    tokens and its log-probs drift from the engine's; with replay it uses the engine's experts for every token
    (agreement 1) and the log-prob difference shrinks."""
    off, on = replayed
    m_off, m_on = off["m1"], on["m1"]
    assert 0.2 < m_off["moe/natural_agreement"] < 0.99
    assert m_off["moe/routing_agreement"] == m_off["moe/natural_agreement"]  # no replay: it used its own choice
    assert m_on["moe/routing_agreement"] == 1.0 and m_on["moe/natural_agreement"] < 0.99
    assert m_on["train_rollout_logprob_diff"] < 0.5 * m_off["train_rollout_logprob_diff"]
    print(f"R3: routing agreement {m_off['moe/routing_agreement']:.3f} -> {m_on['moe/routing_agreement']:.3f}, "
          f"train_rollout_logprob_diff {m_off['train_rollout_logprob_diff']:.2e} -> "
          f"{m_on['train_rollout_logprob_diff']:.2e}")


@pytest.mark.parametrize("nproc,tp,pp,ep", [(2, 2, 1, 1), (2, 1, 1, 2), (2, 1, 2, 1)], ids=["tp2", "ep2", "pp2"])
def test_routing_replay_under_parallelism_matches_one_process(replayed, tmp_path, nproc, tp, pp, ep):
    """Replay cut to each tensor-parallel rank's part of the sequence, to each pipeline stage's layers, and with
    tokens dispatched over expert-parallel ranks, trains as one process does (a reference model is present)."""
    one = replayed[1]
    got = run(tmp_path, nproc, tp, pp, ep, replay="on")
    for step in ("m1", "m2"):
        for key in ("loss", "kl", "entropy", "train_rollout_logprob_diff", "moe/routing_agreement",
                    "moe/natural_agreement"):
            assert got[step][key] == pytest.approx(one[step][key], abs=1e-5), (step, key)
