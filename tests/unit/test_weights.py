import torch


def test_serialized_views_carry_only_their_own_elements():
    import base64

    from rlx.transport.wire import deserialize_named_tensors, serialize_named_tensors

    buffer = torch.arange(1_000_000, dtype=torch.float32)  # like megatron's one buffer for all parameters
    view = buffer[10:20]
    payload = serialize_named_tensors([("w", view)])
    assert len(base64.b64decode(payload)) < 10_000  # not the 4 MB storage behind the view
    (name, t), = deserialize_named_tensors(payload)
    assert name == "w" and t.tolist() == view.tolist()


def test_fused_experts_are_served_under_their_checkpoint_names(tmp_path):
    """transformers 5 fuses a layer's experts in memory and saves them per expert: the engine takes and reports
    them per expert (as trainers push them), writing through to the fused tensors."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlx.rollout.engines.embedded.weights import WeightError, checksums, load_from_disk, load_named, served_state

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                                               moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1, head_dim=8, num_experts=3,
                                               num_experts_per_tok=2))
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    state = served_state(model)
    assert set(state) == set(saved) and not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in state)
    assert all(torch.equal(state[n], t) for n, t in saved.items())
    new = torch.randn(8, 16)
    load_named(model, [("model.layers.0.mlp.experts.2.up_proj.weight", new)])
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj[2, 8:], new)  # [gate; up] per expert
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj[2, :8],
                       saved["model.layers.0.mlp.experts.2.gate_proj.weight"])
    assert "model.layers.0.mlp.experts.1.down_proj.weight" in checksums(model, None)["checksums"]
    assert load_from_disk(model, str(tmp_path)) == len(saved)  # a per-expert checkpoint loads back
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj[2, 8:],
                       saved["model.layers.0.mlp.experts.2.up_proj.weight"])
    try:
        load_named(model, [("model.layers.0.mlp.experts.3.up_proj.weight", new)])
    except WeightError as e:
        assert "unknown weight 'model.layers.0.mlp.experts.3.up_proj.weight'" in str(e)
    else:
        raise AssertionError("an expert the model lacks was accepted")
