"""A checkpoint moves between parallel layouts (megatron's reshardable torch_dist format): saved under one TP/PP/DP
(and EP for a model with experts), a trainer resumed under another takes the next steps as the run that went on did,
within float tolerance, optimizer state included (the third step after the save moves the weights by Adam's second
moment of the steps before). The ranks are forked warm (`rlx.testing.warm`), as torchrun would start them."""

import importlib.util
import json

import pytest

pytestmark = pytest.mark.integration

WORKER = """
import json, pathlib, shutil, sys, time, warnings
warnings.filterwarnings("ignore")


def main():
    import torch
    from rlx.config import parse_config
    from rlx.plugins import build_plugins
    from rlx.train.trainer import Trainer
    from rlx.types import Group, RolloutBatch, Sample, SampleStatus

    model, tp, pp, ep, world, folder, mode, out = sys.argv[1:9]
    lora = {"lora": json.loads(sys.argv[9])} if sys.argv[9:] else {}
    cfg = parse_config(json.dumps({"run": {"output_dir": out + ".run"}, "ray": {"enabled": False},
                                   "model": {"path": model},
                                   "train": {"parallel": {"tp": int(tp), "pp": int(pp), "ep": int(ep),
                                                          "world_size": int(world)},
                                             "optim": {"lr": 1e-2, "adam_eps": 1e-4}, **lora}}))
    g = torch.Generator().manual_seed(0)
    groups, sid = [], 0
    for gid, k in enumerate([3, 2, 4, 1]):
        samples = []
        for j in range(k):
            n = 4 + (sid + j) % 7
            samples.append(Sample(torch.randint(3, 500, (5,), generator=g).tolist(),
                                  torch.randint(3, 500, (n,), generator=g).tolist(), [1] * n, [-6.2] * n,
                                  reward=float((sid + j) % 3), status=SampleStatus.COMPLETED, sample_id=sid + j,
                                  group_id=gid))
        groups.append(Group(gid, samples))
        sid += k
    trainer = Trainer(cfg, build_plugins())
    folder = pathlib.Path(folder)
    seconds = None
    if mode == "save":
        trainer.train_step(RolloutBatch(1, groups))
        t0 = time.monotonic()
        trainer.save(folder)
        seconds = time.monotonic() - t0
    else:
        try:
            trainer.load(folder)
        except Exception as e:
            if torch.distributed.get_rank() == 0:
                json.dump({"error": str(e)}, open(out, "w"))
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
            return
    steps = [trainer.train_step(RolloutBatch(k, groups)) for k in (2, 3)]
    if torch.distributed.get_rank() == 0:
        json.dump({"steps": steps, "save_s": seconds}, open(out, "w"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # (megatron's checkpoint writer spawns a helper process, which imports this module)
    main()
"""

KEYS = ("loss", "pg_loss", "entropy", "grad_norm", "samples", "tokens", "lr")


def run(tmp_path, model, tp, pp, ep, world, folder, mode, lora=None):
    """`lora`: ``train.lora`` (True: rank 4, alpha 8, the default targets)."""
    from rlx.models.tiny import resolve_model_path
    from rlx.testing.warm import world as warm_world

    model = resolve_model_path(model)  # built here once, not by ranks racing in their own cache

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"out-{mode}-{tp}-{pp}-{ep}-{world}.json"
    lora = {"rank": 4, "alpha": 8} if lora is True else lora
    r = warm_world(script, [model, tp, pp, ep, world, folder, mode, out, *([json.dumps(lora)] if lora else [])],
                   int(world),
                   env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


def same_steps(got, want):
    for a, b in zip(got["steps"], want["steps"], strict=True):
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], abs=1e-5), key


@pytest.fixture(scope="module")
def saved_at_tp2(tiny_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp2")
    return tmp, run(tmp, "builtin://tiny-qwen3", 2, 1, 1, 2, tmp / "ckpt", "save")


@pytest.mark.parametrize("tp,pp,world", [(1, 2, 2), (1, 1, 2), (1, 1, 1), (2, 1, 2)],
                         ids=["pp2", "dp2", "one-process", "tp2-same"])
def test_a_checkpoint_saved_at_tp2_resumes_under_another_layout(saved_at_tp2, tp, pp, world):
    tmp, uninterrupted = saved_at_tp2
    resumed = run(tmp, "builtin://tiny-qwen3", tp, pp, 1, world, tmp / "ckpt", f"load-{tp}{pp}{world}")
    same_steps(resumed, uninterrupted)
    assert uninterrupted["steps"][1]["grad_norm"] != uninterrupted["steps"][0]["grad_norm"]  # the model moved
    print(f"saving the tiny model at tp=2 took {uninterrupted['save_s']:.2f} s")


def test_experts_move_between_expert_parallel_layouts_ep_1_included(tmp_path):
    """EP=2 to EP=4 and to EP=1 (one process), and EP=1 to EP=2: megatron keeps the experts in an optimizer of their
    own when ep > 1, whose parameter groups are regrouped on the way (`megatron_patches.checkpoint.regrouped`)."""
    pytest.importorskip("rlx_model_qwen", reason="the tiny MoE model is rlx-model-qwen's (pip install -e "
                                                 "plugins/models/qwen)")
    model = "builtin://tiny-qwen3-moe"
    uninterrupted = run(tmp_path, model, 1, 1, 2, 2, tmp_path / "ckpt", "save")
    same_steps(run(tmp_path, model, 1, 1, 4, 4, tmp_path / "ckpt", "load-ep4"), uninterrupted)
    same_steps(run(tmp_path, model, 1, 1, 1, 1, tmp_path / "ckpt", "load-ep1"), uninterrupted)
    uninterrupted = run(tmp_path, model, 1, 1, 1, 1, tmp_path / "ckpt-ep1", "save")
    same_steps(run(tmp_path, model, 1, 1, 2, 2, tmp_path / "ckpt-ep1", "load-ep2"), uninterrupted)


def test_gated_delta_net_layers_change_tensor_and_pipeline_parallelism(tmp_path):
    """A GDN layer's in_proj rows are each rank's q, k, v, z, beta and a side by side (and conv1d's channels its q,
    k and v): saved as a tensor each, split by heads, they resume from TP=1 at PP=2 and TP=2, and from TP=2 at TP=1,
    dt_bias and A_log (each rank's own heads) included; and LoRA's B on in_proj, split alike, from TP=2 at TP=1."""
    pytest.importorskip("rlx_model_qwen", reason="the tiny Qwen3-Next is rlx-model-qwen's (pip install -e "
                                                 "plugins/models/qwen)")
    model = "builtin://tiny-qwen3-next"
    uninterrupted = run(tmp_path, model, 1, 1, 1, 1, tmp_path / "ckpt", "save")
    same_steps(run(tmp_path, model, 1, 2, 1, 2, tmp_path / "ckpt", "load-pp2"), uninterrupted)
    same_steps(run(tmp_path, model, 2, 1, 1, 2, tmp_path / "ckpt", "load-tp2"), uninterrupted)
    uninterrupted = run(tmp_path, model, 2, 1, 1, 2, tmp_path / "ckpt-tp2", "save")
    same_steps(run(tmp_path, model, 1, 1, 1, 1, tmp_path / "ckpt-tp2", "load-tp1"), uninterrupted)
    # LoRA on in_proj: B's rows are each rank's q, k, v, z, beta and a as the weight's, saved as a tensor each
    lora = {"rank": 4, "alpha": 8, "target_modules": ["in_proj_qkvz", "in_proj_ba", "out_proj"]}
    uninterrupted = run(tmp_path, model, 2, 1, 1, 2, tmp_path / "ckpt-lora", "save", lora=lora)
    same_steps(run(tmp_path, model, 1, 1, 1, 1, tmp_path / "ckpt-lora", "load-lora-tp1", lora=lora), uninterrupted)


def test_full_width_qk_norms_change_tensor_parallelism(tmp_path):
    """MiniMax-M2's q/k norms span every head, their weight split by heads over TP ranks: saved at TP=2 they resume at
    TP=1 (each rank's part where it belongs, not rank 0's everywhere)."""
    pytest.importorskip("rlx_model_minimax", reason="the tiny MiniMax-M2 is rlx-model-minimax's (pip install -e "
                                                    "plugins/models/minimax)")
    model = "builtin://tiny-minimax-m2"
    uninterrupted = run(tmp_path, model, 2, 1, 1, 2, tmp_path / "ckpt", "save")
    same_steps(run(tmp_path, model, 1, 1, 1, 1, tmp_path / "ckpt", "load-tp1"), uninterrupted)


def test_lora_adapters_move_between_layouts(tmp_path):
    """LoRA (`rlx.train.lora`): the adapters and their optimizer state, saved at TP=2 (B split by the rows of
    linear_qkv and of the fused gate/up projection, A by the columns of the row-parallel ones), resume at TP=1 and
    at PP=2; a tiny MoE's experts' adapters saved at EP=2 resume in one process."""
    model = "builtin://tiny-qwen3"
    uninterrupted = run(tmp_path, model, 2, 1, 1, 2, tmp_path / "ckpt", "save", lora=True)
    same_steps(run(tmp_path, model, 1, 1, 1, 1, tmp_path / "ckpt", "load-tp1", lora=True), uninterrupted)
    same_steps(run(tmp_path, model, 1, 2, 1, 2, tmp_path / "ckpt", "load-pp2", lora=True), uninterrupted)
    if importlib.util.find_spec("rlx_model_qwen") is None:
        print("the tiny MoE is rlx-model-qwen's, which is not installed: its experts' adapters are not checked")
        return
    model = "builtin://tiny-qwen3-moe"
    uninterrupted = run(tmp_path, model, 1, 1, 2, 2, tmp_path / "ckpt-moe", "save", lora=True)
    same_steps(run(tmp_path, model, 1, 1, 1, 1, tmp_path / "ckpt-moe", "load-ep1", lora=True), uninterrupted)

