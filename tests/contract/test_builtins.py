"""The built-in components pass the contract suites plugin authors use."""

import pytest
from rlx.testing import (
    AdvantageContract,
    GeneratorContract,
    LoggerContract,
    LossContract,
    ModelBridgeContract,
    RewardCase,
    RewardContract,
    TransportContract,
)


class TestExactMatch(RewardContract):
    reward_name = "exact_match"
    cases = [RewardCase("42", "42", 1.0), RewardCase(" 42 ", "42", 1.0), RewardCase("41", "42", 0.0)]


class TestDigits(RewardContract):
    reward_name = "digits"
    cases = [RewardCase("12", None, 1.0), RewardCase("ab", None, 0.0), RewardCase("1a", None, 0.5)]


class TestGRPO(AdvantageContract):
    estimator_name = "grpo"


class TestReinforcePP(AdvantageContract):
    estimator_name = "reinforce_pp"


class TestReinforcePPBaseline(AdvantageContract):
    estimator_name = "reinforce_pp_baseline"


class TestPPOClip(LossContract):
    loss_name = "ppo_clip"


class TestGSPO(LossContract):
    loss_name = "gspo"


class TestCISPO(LossContract):
    loss_name = "cispo"


class TestSingleTurn(GeneratorContract):
    generator_name = "single_turn"


class TestLlamaBridge(ModelBridgeContract):
    bridge_name = "llama"
    model_type = "qwen3"

    def make_checkpoint(self, folder):
        import shutil

        from rlx.models.tiny import resolve_model_path

        shutil.copytree(resolve_model_path("builtin://tiny-qwen3"), folder, dirs_exist_ok=True)


class TestLlamaBridgeQwen2(ModelBridgeContract):
    """qkv biases, tied embeddings."""

    bridge_name = "llama"
    model_type = "qwen2"
    layouts = [(1, 1), (2, 1), (2, 2)]

    def make_checkpoint(self, folder):
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        m = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.1)
        m.save_pretrained(folder)


class TestLlamaBridgeUntied(ModelBridgeContract):
    bridge_name = "llama"
    model_type = "llama"
    layouts = [(1, 1), (2, 2)]

    def make_checkpoint(self, folder):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=False)).save_pretrained(folder)


@pytest.mark.integration
class TestTensorTransport(TransportContract):
    transport_name = "tensor"


@pytest.mark.integration
class TestDiskTransport(TransportContract):
    transport_name = "disk"


@pytest.mark.integration
class TestBroadcastTransport(TransportContract):
    transport_name = "broadcast"


class TestTensorBoard(LoggerContract):
    """Read back from the event files: scalars by step, the config from its YAML text, samples from the
    markdown table (cells with `|` escaped and newlines as <br>)."""

    logger_name = "tensorboard"

    def read_back(self, output_dir):
        import re

        import yaml
        from rlx.builtins.loggers import read_events

        config, history, tables = {}, {}, {}
        for e in read_events(output_dir / "tensorboard"):
            for v in e.summary.value:
                if v.HasField("simple_value"):
                    history.setdefault(e.step, {})[v.tag] = v.simple_value
                elif v.tag.startswith("config/"):
                    config = yaml.safe_load(v.tensor.string_val[0].decode().strip("`\n"))
                elif v.tag.startswith("samples/"):
                    lines = v.tensor.string_val[0].decode().splitlines()[2:]
                    cells = [[c.strip().replace("\\|", "|").replace("<br>", "\n")
                              for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
                    tables[e.step] = [{"prompt": p, "response": r, "reward": float(w)} for p, r, w in cells]
        return config, history, tables
