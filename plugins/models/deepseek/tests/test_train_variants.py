"""`rl train` from DeepSeek-V3 checkpoints as published. FP8 (block-quantised e4m3 with ``weight_scale_inv``): the
trainer reads it dequantised, the engine (transformers, dequantising on a CPU) serves what the trainer holds, and
the export writes either the trainer's weights without the quantisation config, or FP8 again with scales recomputed
from the trained weights (``model.export_weights: fp8``), which transformers loads. With a multi-token-prediction
layer: not trained, written back unchanged."""

import json

import pytest

from rlx.models.fp8 import write_quantized
from rlx.testing.runs import train_and_export

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    from rlx.models.tiny import resolve_model_path

    return write_quantized(resolve_model_path("builtin://tiny-deepseek-v3"), tmp_path_factory.mktemp("fp8"), (16, 16))


@pytest.mark.parametrize("export", ["auto", "fp8"])
def test_an_fp8_checkpoint_trains_and_exports(fp8_model, tmp_path, export):
    import torch

    from rlx.models.fp8 import dequantize
    from rlx.models.load import load_lm

    run = train_and_export(tmp_path, str(fp8_model), 3, f"model.export_weights={export}")
    rows, before, after = run["rows"], run["before"], run["after"]
    assert len(rows) == 3 and max(r["train_rollout_logprob_diff"] for r in rows) < 1e-4
    name = "model.layers.1.self_attn.q_b_proj.weight"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if export == "auto":
        assert set(after) == {n for n in before if not n.endswith("_scale_inv")}
        assert after[name].dtype == torch.float32 and "quantization_config" not in config
    else:
        assert set(after) == set(before) and after[name].dtype == torch.float8_e4m3fn
        assert config["quantization_config"]["weight_block_size"] == [16, 16]
        trained = dequantize(after[name], after[name + "_scale_inv"], (16, 16))
        assert not torch.equal(trained, dequantize(before[name], before[name + "_scale_inv"], (16, 16)))
        assert after["model.embed_tokens.weight"].dtype == torch.float32  # (not quantised in the source either)
    model = load_lm(tmp_path / "hf", torch.float32)
    assert model(torch.tensor([[3, 4, 5]])).logits.isfinite().all()


def test_the_mtp_layer_is_written_back_unchanged(tmp_path):
    import shutil

    import torch

    from rlx.models.tiny import resolve_model_path
    from rlx.testing.models import with_mtp_layer

    folder = tmp_path / "mtp"
    shutil.copytree(resolve_model_path("builtin://tiny-deepseek-v3"), folder)
    with_mtp_layer(folder)
    run = train_and_export(tmp_path, str(folder), 3)
    before, after = run["before"], run["after"]
    assert set(after) == set(before) and max(r["train_rollout_logprob_diff"] for r in run["rows"]) < 1e-4
    mtp = [n for n in before if n.startswith("model.layers.4.")]
    assert len(mtp) > 6 and all(torch.equal(after[n], before[n]) for n in mtp)
    name = "model.layers.3.self_attn.o_proj.weight"
    assert not torch.equal(after[name], before[name])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_trained_mtp_layer_reaches_the_engine_and_the_export(tmp_path):
    """``train.objective.mtp_loss_coef``: the MTP layer trains (its loss reported each step), every push carries it
    and is verified on the engine, which holds it beside the model transformers serves and drafts with it
    (``speculative.method: mtp``: the drafted tokens keep the policy's log-probs); the export writes it trained,
    with its copies of the embedding and output layer equal to the model's."""
    import torch

    from rlx.testing.models import mtp_copy

    run = train_and_export(tmp_path, str(mtp_copy("builtin://tiny-deepseek-v3", tmp_path / "mtp")), 3,
                           "train.objective.mtp_loss_coef=0.5", "rollout.engines.0.speculative.method=mtp")
    rows, before, after = run["rows"], run["before"], run["after"]
    assert all(r["mtp_loss"] > 0 for r in rows) and max(r["train_rollout_logprob_diff"] for r in rows) < 1e-4
    assert all(0 <= r["rollout/spec_accept_rate"] <= 1 and r["rollout/spec_accept_length"] >= 1 for r in rows)
    assert set(after) == set(before)
    for name in ("eh_proj.weight", "self_attn.q_b_proj.weight", "mlp.shared_experts.up_proj.weight"):
        assert not torch.equal(after[f"model.layers.4.{name}"], before[f"model.layers.4.{name}"]), name
    assert torch.equal(after["model.layers.4.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert torch.equal(after["model.layers.4.shared_head.head.weight"], after["lm_head.weight"])
