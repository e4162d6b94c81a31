"""GLM's multi-token-prediction layers (`rlx.train.mtp`): GLM-4.5's (grouped-query attention) and GLM-5's (a full
sparse-attention layer with its own indexer) predict as a reference built by hand from transformers' own layers, and
`rl train` on GLM-5 trains its MTP layer, pushes it (verified on the engine) and exports it. GLM-4.5's drafts in the
embedded engine (`speculative.method: mtp`) are its MTP layer's predictions; GLM-5's are refused at preflight."""

import pytest

from rlx.testing.models import mtp_copy, mtp_draft_errors, mtp_reference_error
from rlx.testing.runs import sparse_engine_follows, train_and_export

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("model,model_type", [("builtin://tiny-glm4-moe", "glm4_moe"),
                                              ("builtin://tiny-glm5", "glm_moe_dsa")])
def test_the_mtp_layer_predicts_as_a_reference_built_from_transformers(tmp_path, model, model_type):
    assert mtp_reference_error(mtp_copy(model, tmp_path / "mtp"), model_type) < 1e-5


def test_rl_train_trains_glm5s_mtp_layer(tmp_path):
    import torch

    run = train_and_export(tmp_path, str(mtp_copy("builtin://tiny-glm5", tmp_path / "mtp")), 3,
                           "train.objective.mtp_loss_coef=0.5")
    rows, before, after = run["rows"], run["before"], run["after"]
    assert all(r["mtp_loss"] > 0 for r in rows) and sparse_engine_follows(rows)
    assert set(after) == set(before)
    for name in ("eh_proj.weight", "self_attn.kv_b_proj.weight"):
        assert not torch.equal(after[f"model.layers.4.{name}"], before[f"model.layers.4.{name}"]), name
    indexer = "model.layers.4.self_attn.indexer.wq_b.weight"  # frozen, as the model's (indexer_kl_coef 0)
    assert torch.equal(after[indexer], before[indexer])


def test_glm45_mtp_drafts_and_glm5s_refused(tmp_path):
    from rlx.config import load_config
    from rlx.errors import ConfigError
    from rlx.preflight import config_checks

    got = mtp_draft_errors(mtp_copy("builtin://tiny-glm4-moe", tmp_path / "glm45"), 0.0)
    assert got["drafted"] > 9 * 4 and got["draft"] < 1e-4 and got["logprob"] < 1e-5 and got["same"]
    glm5 = mtp_copy("builtin://tiny-glm5", tmp_path / "glm5")
    (tmp_path / "c.yaml").write_text(f"model: {{path: {glm5}}}\nrollout:\n  engines: [{{speculative: {{method: mtp}}}}]\n")
    with pytest.raises(ConfigError, match="sparse-attention MTP layer"):
        load_config(tmp_path / "c.yaml", checks=config_checks(files=True))
