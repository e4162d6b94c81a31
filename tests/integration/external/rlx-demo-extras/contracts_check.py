"""The plugin's own tests: rlx's contract suites, run against the installed distribution (entry points)."""

import pytest

from rlx.testing import LossContract, ModelBridgeContract, TransportContract


def make_phi3(folder):
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(folder)


class TestPhi3Bridge(ModelBridgeContract):
    bridge_name = "phi3"
    model_type = "phi3"

    def make_checkpoint(self, folder):
        make_phi3(folder)


class TestVanillaPG(LossContract):
    loss_name = "vanilla_pg"


@pytest.mark.integration
class TestOneByOne(TransportContract):
    transport_name = "one-by-one"
