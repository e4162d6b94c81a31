"""Qwen3-Next under megatron on CPU (gloo, torchrun): tensor parallelism trains exactly like one process (the same
losses and updated weights within 1e-5), with each rank holding its own GDN key heads (in_proj rows, convolution
channels, decay and gate parameters) and its own attention query groups."""

import pytest

from rlx.testing.parallel import assert_same, run

pytestmark = pytest.mark.integration

MODEL = "builtin://tiny-qwen3-next"


def test_tensor_parallel_matches_one_process(tmp_path):
    single = run(tmp_path, MODEL, 1)
    got = run(tmp_path, MODEL, 2, tp=2)
    assert_same(got, single, ("loss", "pg_loss", "entropy", "kl", "samples", "tokens"))
    assert single["m2"]["kl"] > 0 and single["m1"]["loss"] != single["m2"]["loss"]  # the model did move
    names = set(single["weights"])
    assert {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.A_log",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight"} <= names


@pytest.mark.parametrize("model,gdn", [(MODEL, ["in_proj_qkvz", "in_proj_ba"]),
                                       ("builtin://tiny-qwen3.5", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])])
def test_lora_on_gated_delta_nets_and_gated_attention_trains_at_tp2_as_one_process_and_loads_in_peft(tmp_path, model,
                                                                                                      gdn):
    """LoRA (`rlx.train.lora`) on the GDN layers' in_proj (q, k, v, z, beta and a rows, each rank's own heads) and
    out_proj, and on the gated attention's q (query and gate rows)/k/v/o: TP=2 trains as one process, and the adapters,
    as peft names and lays them out for the transformers model (Qwen3-Next's in_proj_qkvz and in_proj_ba grouped per
    key head; Qwen3.5's flat in_proj_qkv, _z, _b, _a), load in peft over the original model with the merged model's
    logits within 1e-5."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from rlx.models.tiny import resolve_model_path
    from rlx.transport.payloads import save_peft_adapter

    targets = [*gdn, "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"]
    lora = {"rank": 4, "alpha": 8, "target_modules": targets}
    single = run(tmp_path, model, 1, lora=lora)
    assert_same(run(tmp_path, model, 2, tp=2, lora=lora), single, ("loss", "pg_loss", "entropy", "kl", "lora/params"))
    path = resolve_model_path(model)
    auto = AutoModelForImageTextToText if "3.5" in model else AutoModelForCausalLM  # (Qwen3.5 as published: with vision)
    base = auto.from_pretrained(path, dtype=torch.float32).eval()
    merged = auto.from_pretrained(path, dtype=torch.float32).eval()
    state = merged.state_dict()
    # (the adapted projections' merged weights; transformers fuses the experts, which LoRA leaves as they are here)
    adapted = {n: torch.tensor(w).reshape(state[n].shape) for n, w in single["weights"].items()
               if n.endswith(".weight") and n.rpartition(".")[0].endswith(tuple(targets))}
    assert len(adapted) == 2 * (len(gdn) + 1) + 2 * 4  # two GDN layers' in_proj parts and out_proj; two attention q/k/v/o
    merged.load_state_dict(adapted, strict=False)
    factors = {}
    for name, w in single["weights"].items():
        if ".lora_" in name:
            module, kind = name.rsplit(".", 1)
            t = torch.tensor(w)
            factors[f"base_model.model.{module}.{kind}.weight"] = t.reshape(4, -1) if kind == "lora_A" else t.reshape(-1, 4)
    assert {k.split(".")[-3] for k in factors} == set(targets)
    save_peft_adapter(tmp_path / "adapter", factors, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "inference_mode": True})
    ids = torch.tensor([[1, 264, 263, 201, 284, 324, 5, 17, 42, 7, 9, 11]])
    with torch.no_grad():
        want, before = merged(input_ids=ids).logits, base(input_ids=ids).logits
        got = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits
    assert (want - before).abs().max() > 1e-3  # the adapters moved the model
    assert (got - want).abs().max() < 1e-5
