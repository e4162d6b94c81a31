"""Multi-process Megatron on CPU (gloo; the ranks forked warm by `rlx.testing.warm`, as torchrun would start them): TP=2, DP=2, PP=2 and their products train exactly
like one process: the same losses, entropy and updated weights, within 1e-5."""

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

    tp, pp, world, out, method = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    objective = {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_norm": "group"}
    extra = {}
    ray = {"enabled": False}
    if method.startswith("ppo"):  # a critic beside the actor, the KL in the reward
        objective.update(advantage={"name": "gae", "args": {"lam": 0.9}}, kl_in_reward=True)
        extra = {"critic": {"optim": {"lr": 1e-2, "adam_eps": 1e-4}, "value_clip": 0.5}}
    if method == "ppo-ray":  # the critic in ranks of its own: TP=2 over 2 processes, beside a 1-process actor
        extra["critic"]["parallel"] = {"world_size": 2, "tp": 2}
        ray = {"placement": "colocated", "cpus_per_trainer": 0.25, "cpus_per_engine": 0.25}
    cfg = parse_config(json.dumps({
        "run": {"output_dir": out + ".run"}, "ray": ray,
        "model": {"path": "builtin://tiny-qwen3"},
        "train": {"parallel": {"tp": tp, "pp": pp, "world_size": world}, "updates_per_step": 2,
                  "objective": objective, **extra,
                  "max_tokens_per_micro_batch": 40,
                  # Adam divides by sqrt(v) + eps: with a tiny eps, a gradient element that is ~0 takes
                  # a full +-lr step whose sign is float noise. A moderate eps keeps the comparison of
                  # updated weights about the gradients rather than that noise.
                  "optim": {"lr": 1e-2, "adam_eps": 1e-4}}}))
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
    if method == "ppo-ray":
        import pathlib
        from rlx.orchestrate.placement import RayPlacement, ray_trainer_group
        placement = RayPlacement(cfg)
        try:
            group = ray_trainer_group(cfg, placement.pg)
            m1 = group.train_step(RolloutBatch(1, groups))
            m2 = group.train_step(RolloutBatch(2, groups))
            folder = pathlib.Path(out + ".ckpt")
            folder.mkdir()
            group.save(folder)
            m3 = group.train_step(RolloutBatch(3, groups))
            group.shutdown()
            group = ray_trainer_group(cfg, placement.pg)  # a restart: both models from the checkpoint
            group.load(folder)
            again = group.train_step(RolloutBatch(3, groups))
            group.shutdown()
        finally:
            placement.shutdown()
        json.dump({"m1": m1, "m2": m2, "resumed": [again, m3]}, open(out, "w"))
        sys.exit(0)
    trainer = Trainer(cfg, build_plugins())
    m1 = trainer.train_step(RolloutBatch(1, groups))
    m2 = trainer.train_step(RolloutBatch(2, groups))
    # each pipeline stage's sender streams its own tensors; gather them all to rank 0 to compare
    mine = {k: v.flatten().tolist() for k, v in trainer.hf_tensors()} if trainer.par.sender else {}
    if trainer.par.dp_rank == 0 and not trainer.par.sender:
        for _ in trainer.hf_tensors():
            pass
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    resumed = None  # after the weights were taken
    if method == "ppo" and world == 1:  # a checkpoint holds both models: a restored trainer steps exactly alike
        import pathlib, tempfile
        folder = pathlib.Path(tempfile.mkdtemp())
        trainer.save(folder)
        again = Trainer(cfg, build_plugins())
        again.load(folder)
        resumed = [again.train_step(RolloutBatch(3, groups)), trainer.train_step(RolloutBatch(3, groups))]
        # a critic checkpoint with a value head (transformers' score.weight) starts the head from it
        import shutil
        from safetensors.torch import save_file
        from rlx.errors import RLXError
        from rlx.train.model import ModelRole
        ckpt = pathlib.Path(tempfile.mkdtemp()) / "critic"
        shutil.copytree(trainer.model_path, ckpt)
        hidden = trainer.critic.config.hidden_size
        save_file({"score.weight": torch.full((1, hidden), 0.5)}, str(ckpt / "score.safetensors"))
        role = ModelRole("critic", trainer.spec, trainer.par, cfg.train.parallel, torch.float32, value_head=True)
        role.load_hf(ckpt)
        resumed.append(role.model.output_layer.weight.flatten().tolist())
        # a reward model's checkpoint: untied, a score head and no LM head at all
        hf_cfg = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**hf_cfg, "tie_word_embeddings": False}))
        from rlx.train.spec import model_spec
        untied = model_spec(ckpt, build_plugins())
        assert not untied.tied
        role = ModelRole("critic", untied, trainer.par, cfg.train.parallel, torch.float32, value_head=True)
        role.load_hf(ckpt)
        resumed.append(role.model.output_layer.weight.flatten().tolist())
        (ckpt / "config.json").write_text(json.dumps(hf_cfg))
        save_file({"score.weight": torch.zeros(2, hidden)}, str(ckpt / "score.safetensors"))
        try:
            ModelRole("critic", trainer.spec, trainer.par, cfg.train.parallel, torch.float32,
                      value_head=True).load_hf(ckpt)
        except RLXError as e:
            resumed.append(str(e))
    if torch.distributed.get_rank() == 0:
        weights = {k: v for p in parts for k, v in p.items()}
        json.dump({"m1": m1, "m2": m2, "weights": weights, "resumed": resumed}, open(out, "w"))
    torch.distributed.barrier()  # as rlx.testing.parallel: leave the groups before exit, after the result
    torch.distributed.destroy_process_group()
""")


def run(tmp_path, nproc, tp, pp=1, method="grpo"):
    from rlx.testing.warm import world

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"out-{nproc}-{tp}-{pp}-{method}.json"
    args = [str(tp), str(pp), str(nproc), str(out), method]

    def launch():
        if method == "ppo-ray":  # Ray starts the processes itself
            return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        return world(script, args, nproc, env={"OMP_NUM_THREADS": "1"})

    r = launch()
    if r.returncode == -6 and "terminate called" in r.stderr:  # -6: a rank ended by SIGABRT
        # Seen once in about thirty runs: a worker aborted inside gloo's C++ ("terminate called without an
        # active exception") a second after start. That is not a difference in the numbers, which this test
        # checks; run it once more, and say so.
        import warnings

        warnings.warn(f"{method} tp={tp} pp={pp} nproc={nproc}: a worker aborted in C++; ran again", stacklevel=1)
        r = launch()
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


def test_a_warm_world_ends_when_a_rank_fails_or_at_its_timeout_and_leaves_no_rank_behind(tmp_path):
    from rlx.testing.warm import world

    os.mkfifo(tmp_path / "never")  # opening it to read waits for a writer that never comes
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import os, pathlib, sys, time
        rank = int(os.environ["RANK"])
        print("rank", rank, "of", os.environ["WORLD_SIZE"], flush=True)
        pathlib.Path(sys.argv[1], str(os.getpid())).touch()
        if rank == 1 and sys.argv[2] == "fail":
            while sum(p.name.isdigit() for p in pathlib.Path(sys.argv[1]).iterdir()) < 3:
                time.sleep(0.01)  # every rank has started: the others are killed, not never forked
            raise SystemExit("rank 1 gives up")
        open(sys.argv[3]).read()
    """))

    def ranks_left():
        pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
        assert len(pids) == 3
        for p in tmp_path.iterdir():
            if p.name.isdigit():
                p.unlink()
        return [pid for pid in pids if os.path.exists(f"/proc/{pid}")]

    r = world(script, [tmp_path, "fail", tmp_path / "never"], 3, timeout=600)
    assert r.returncode == 1 and "rank 1 gives up" in r.stderr, r
    assert r.stdout.splitlines() == [f"rank {i} of 3" for i in range(3)]
    assert ranks_left() == []  # ranks 0 and 2 were waiting on the fifo: killed as rank 1 failed
    with pytest.raises(subprocess.TimeoutExpired):
        world(script, [tmp_path, "wait", tmp_path / "never"], 3, timeout=5)
    assert ranks_left() == []
    # a rank that fails at once may end the others before they begin (nothing written): still its code, no error
    quick = tmp_path / "quick.py"
    quick.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(3)\nopen(sys.argv[1]).read()\n")
    assert world(quick, [tmp_path / "never"], 3, timeout=600).returncode == 3


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


@pytest.fixture(scope="module")
def single_ppo(tiny_model_path, tmp_path_factory):
    return run(tmp_path_factory.mktemp("single-ppo"), 1, 1, method="ppo")


@pytest.mark.parametrize("nproc,tp,pp", [(2, 1, 1), (4, 2, 2)], ids=["dp2", "tp2-pp2"])
def test_ppo_with_a_critic_matches_one_process(single_ppo, tmp_path, nproc, tp, pp):
    """The critic's values, value loss and explained variance, the KL in the reward and the actor's update agree
    with one process: the values every rank gathers, the whitening over the whole batch and the critic's
    updates on data-parallel shares add up to the same numbers."""
    got = run(tmp_path, nproc, tp, pp, method="ppo")
    keys = ("loss", "pg_loss", "entropy", "kl", "critic/value_loss", "critic/value_mean", "critic/returns_mean",
            "critic/explained_variance", "critic/value_clip_frac", "critic/grad_norm", "samples")
    for step in ("m1", "m2"):
        for key in keys:
            assert got[step][key] == pytest.approx(single_ppo[step][key], abs=1e-5), (step, key)
    m1, m2 = single_ppo["m1"], single_ppo["m2"]
    assert m1["critic/value_mean"] == 0 and m2["critic/value_mean"] != 0  # the head starts at 0 and learns
    assert m2["kl"] != 0 and m2["critic/value_loss"] < m1["critic/value_loss"]
    worst = max(max(abs(a - b) for a, b in zip(got["weights"][n], w)) for n, w in single_ppo["weights"].items())
    assert worst < 1e-5, f"updated weights differ by up to {worst}"


def test_ppo_checkpoint_restores_the_critic_and_the_actor_and_a_value_head_loads_from_score_weight(single_ppo):
    restored, original, head, untied_head, error = single_ppo["resumed"]
    assert restored == original  # step 3 from the checkpoint of step 2, and step 3 of the trainer that went on
    assert restored["critic/value_mean"] != 0 and restored["critic/lr"] == 1e-2
    assert set(head) == {0.5}  # a value head from the critic checkpoint's score.weight
    assert set(untied_head) == {0.5}  # also from a reward model's checkpoint, which has no LM head
    assert error.endswith("score.weight has shape (2, 64); a critic's value head is [1, 64]"), error


def test_a_critic_with_a_layout_of_its_own_matches_the_critic_beside_the_actor(single_ppo, tmp_path):
    """Critic TP=2 in two Ray processes of its own, actor TP=1 in one, on shared bundles: the same numbers as
    the critic in the actor's process; a checkpoint restores both groups exactly."""
    got = run(tmp_path, 1, 1, method="ppo-ray")
    keys = ("loss", "pg_loss", "entropy", "kl", "critic/value_loss", "critic/value_mean", "critic/returns_mean",
            "critic/explained_variance", "critic/value_clip_frac", "critic/grad_norm", "samples")
    for step in ("m1", "m2"):
        for key in keys:
            assert got[step][key] == pytest.approx(single_ppo[step][key], abs=1e-5), (step, key)
    restored, original = got["resumed"]
    assert restored == pytest.approx(original, abs=1e-6)


def test_top_k_distillation_at_tp2_matches_one_process(tiny_model_path, tmp_path):
    """The top-k distillation term reads the student's log-probs at the teacher's ids from a vocabulary split over
    tensor-parallel ranks (`rlx.train.distill.vocab_logprobs`): the same loss, term and updated weights as one
    process."""
    from rlx.testing.parallel import assert_same, run as run_layout

    objective = {"distill": {"estimator": "top_k", "top_k": 6, "coef": 0.5}}
    single = run_layout(tmp_path, tiny_model_path, 1, objective=objective)
    assert single["m1"]["distill_topk_kl"] > 0 and single["m2"]["distill_topk_kl"] < single["m1"]["distill_topk_kl"]
    got = run_layout(tmp_path, tiny_model_path, 2, tp=2, objective=objective)
    assert_same(got, single, ("loss", "pg_loss", "distill_topk_kl", "entropy", "kl"))
