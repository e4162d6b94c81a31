"""rlx's GRPO step on one batch equals the objective written out from the papers in float64, and TRL's GRPO loss
on the same samples: advantages, loss, gradient per tensor (through megatron, micro-batches and the HF mapping),
and the update after the gradient-norm clip and Adam. The batch and the reference: objective_side.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SIDE = Path(__file__).with_name("objective_side.py")


@pytest.fixture(scope="module")
def figures(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("objective") / "figures.json"
    r = subprocess.run([sys.executable, str(SIDE), str(tiny_model_path), str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_batch_spans_many_micro_batches(figures):
    # the loss is summed over micro-batches: a normalisation per micro-batch would show below
    assert figures["micro_batches"] >= 5


def test_advantages_are_grpo_with_the_population_std(figures):
    adv = figures["advantages"]
    assert adv["rlx"].keys() == adv["reference"].keys()
    for k, v in adv["reference"].items():
        assert adv["rlx"][k] == pytest.approx(v, abs=1e-9), k
    assert adv["rlx"]["7"] == 0.0 and adv["rlx"]["8"] == 0.0  # a group of equal rewards


def test_the_loss_equals_the_float64_objective_and_trls(figures):
    loss = figures["loss"]
    assert abs(loss["reference"]) > 1e-3
    assert loss["rlx"] == pytest.approx(loss["reference"], rel=1e-5)
    assert loss["trl"] == pytest.approx(loss["reference"], rel=1e-5)


def test_every_gradient_equals_the_float64_objectives_and_trls(figures):
    assert not figures["missing"]
    bad = {k: e for k, e in figures["grads"].items() if e[0] > 1e-4 or e[1] > 1e-4}
    assert not bad, bad  # relative error of [rlx, TRL] against float64, per tensor
    norm = figures["grad_norm"]
    assert norm["rlx"] == pytest.approx(norm["reference"], rel=1e-5)  # reported before the clip


def test_the_update_is_one_adam_step_on_the_clipped_gradient(figures):
    norm = figures["grad_norm"]
    assert norm["reference"] > 2 * norm["clip"]  # the clip is active, so where it applies shows
    bad = {k: e for k, e in figures["update"].items() if e > 1e-3}
    assert not bad, bad
