"""Trained multi-token-prediction layers (`rlx.train.mtp`, ``train.objective.mtp_loss_coef``) on DeepSeek-V3's and
V3.2's tiny checkpoints with an MTP layer in the published layout: the trainer's MTP layer predicts as a reference
built by hand from transformers' own layers does; it trains beside the policy without changing the policy's update;
TP=2 x EP=2 trains it as one process does; a checkpoint keeps it. (`test_train_variants.py`: `rl train` with it, and
frozen.)"""

import pytest

from rlx.testing.models import mtp_copy, mtp_reference_error
from rlx.testing.parallel import assert_same, run

pytestmark = pytest.mark.integration

MODEL = "builtin://tiny-deepseek-v3"


@pytest.mark.parametrize("model,model_type", [(MODEL, "deepseek_v3"), ("builtin://tiny-deepseek-v3.2", "deepseek_v32")])
def test_the_mtp_layer_predicts_as_a_reference_built_from_transformers(tmp_path, model, model_type):
    assert mtp_reference_error(mtp_copy(model, tmp_path / "mtp"), model_type) < 1e-5


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    return str(mtp_copy(MODEL, tmp_path_factory.mktemp("model") / "mtp"))


@pytest.fixture(scope="module")
def trained(mtp_model, tmp_path_factory):
    return run(tmp_path_factory.mktemp("trained"), mtp_model, 1, objective={"mtp_loss_coef": 0.5},
               optim={"clip_grad": 0})


def test_training_the_mtp_layer_leaves_the_policy_update_as_it_was(mtp_model, trained, tmp_path):
    """Detached: the MTP loss reaches only the MTP layer, so the policy's weights after two steps are the ones a run
    that keeps the MTP layer frozen gets (gradient clipping off: its norm would count the MTP layer's gradient)."""
    frozen = run(tmp_path, mtp_model, 1, optim={"clip_grad": 0})
    policy, both = frozen["weights"], trained["weights"]
    mtp = set(both) - set(policy)
    assert mtp and all(n.startswith("model.layers.4.") for n in mtp) and set(policy) < set(both)
    worst = max(max(abs(a - b) for a, b in zip(both[n], w, strict=True)) for n, w in policy.items())
    assert worst == 0.0
    for step in ("m1", "m2"):
        assert trained[step]["pg_loss"] == frozen[step]["pg_loss"] and trained[step]["mtp_loss"] > 0
    assert trained["m2"]["mtp_loss"] < trained["m1"]["mtp_loss"]  # the same samples, after two updates on them


def test_tensor_and_expert_parallel_train_the_mtp_layer_as_one_process(mtp_model, trained, tmp_path):
    got = run(tmp_path, mtp_model, 4, 2, 1, 2, objective={"mtp_loss_coef": 0.5}, optim={"clip_grad": 0})
    assert_same(got, trained, ("loss", "pg_loss", "kl", "mtp_loss", "moe/aux_loss"))


RESUME = """
import json, sys, warnings
from pathlib import Path
warnings.filterwarnings("ignore")
import torch
from rlx.config import parse_config
from rlx.plugins import build_plugins
from rlx.train.trainer import Trainer
from rlx.types import Group, RolloutBatch, Sample, SampleStatus

model, out = sys.argv[1:3]
cfg = parse_config(json.dumps({"run": {"output_dir": out + ".run"}, "ray": {"enabled": False}, "model": {"path": model},
                               "train": {"parallel": {"world_size": 1}, "objective": {"mtp_loss_coef": 0.5}}}))
trainer = Trainer(cfg, build_plugins())
g = torch.Generator().manual_seed(0)
samples = [Sample(torch.randint(3, 500, (5,), generator=g).tolist(), torch.randint(3, 500, (6,), generator=g).tolist(),
                  [1] * 6, [-6.0] * 6, reward=float(i), status=SampleStatus.COMPLETED, sample_id=i, group_id=0)
           for i in range(2)]
trainer.train_step(RolloutBatch(1, [Group(0, samples)]))
mtp = {n: p for n, p in trainer.actor.model.named_parameters() if n.startswith("mtp.")}
saved = {n: p.detach().clone() for n, p in mtp.items()}
trainer.save(Path(out))
with torch.no_grad():
    for p in mtp.values():
        p.zero_()
trainer.load(Path(out))
print("RESULT", json.dumps([len(mtp), all(torch.equal(p, saved[n]) for n, p in mtp.items())]))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


def test_a_checkpoint_keeps_the_trained_mtp_layer(mtp_model, tmp_path):
    import json

    from rlx.testing.warm import world

    (tmp_path / "resume.py").write_text(RESUME)
    r = world(tmp_path / "resume.py", [mtp_model, str(tmp_path / "ckpt")], 1)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    count, same = json.loads(lines[0][len("RESULT "):])
    assert count > 10 and same
