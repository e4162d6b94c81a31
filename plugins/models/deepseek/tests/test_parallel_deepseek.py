"""DeepSeek-V3 under megatron on CPU (gloo, torchrun): expert, pipeline and tensor×expert parallelism train exactly
like one process, with latent attention under YaRN (its latent projections split by rows over tensor-parallel
ranks and gathered; tp2-ep2 fails without `rlx.train.mla`'s fix for the rotary key's gradient, which megatron
leaves unsummed over tensor-parallel ranks), shared experts, a dense first layer and the aux-loss-free correction
bias updated after every optimizer step. (Routing replay is router-level: the perturbed-router tests run on Qwen3-MoE and GLM-4.5, and
`test_train_deepseek.py` replays the embedded engine's routing through latent-attention layers.)"""

import pytest

from rlx.testing.parallel import assert_same, run

pytestmark = pytest.mark.integration

MODEL = "builtin://tiny-deepseek-v3"
KEYS = ("loss", "pg_loss", "entropy", "kl", "samples", "tokens", "moe/aux_loss", "moe/load_max_mean")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), MODEL, 1)


@pytest.mark.parametrize("nproc,tp,pp,ep", [(2, 1, 1, 2), (2, 1, 2, 1), (4, 2, 1, 2)], ids=["ep2", "pp2", "tp2-ep2"])
def test_parallel_matches_one_process(single, tmp_path, nproc, tp, pp, ep):
    assert_same(run(tmp_path, MODEL, nproc, tp, pp, ep), single, KEYS)


def test_lora_on_latent_attention_and_experts_at_tp2_matches_one_process(tmp_path):
    """LoRA (`rlx.train.lora`) on every projection DeepSeek-V3 has, latent attention's down and up projections
    and the experts' included: at TP=2 the experts are split over expert tensor-parallel ranks, whose token
    dispatcher (not the projection) gathers their input and sums their output, and their adapters follow it."""
    lora = {"rank": 4, "alpha": 8, "target_modules": ["o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj",
                                                      "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]}
    single = run(tmp_path, MODEL, 1, lora=lora)
    assert_same(run(tmp_path, MODEL, 2, tp=2, lora=lora), single, ("loss", "pg_loss", "entropy", "kl", "grad_norm",
                                                                  "lora/params"))
    from pathlib import Path

    from safetensors.torch import load_file

    from rlx.models.tiny import resolve_model_path

    loaded = {}
    for f in Path(resolve_model_path(MODEL)).glob("*.safetensors"):
        loaded.update(load_file(f))
    biases = [n for n in single["weights"] if n.endswith("e_score_correction_bias")]
    assert biases and all(single["weights"][n] == loaded[n].float().tolist() for n in biases)  # the base's: frozen
