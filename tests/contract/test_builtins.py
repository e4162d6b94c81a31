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
from rlx.testing.runs import read_events


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
    """Through shared memory (the engine is on this host)."""

    transport_name = "tensor"


@pytest.mark.integration
class TestTensorTransportByValue(TransportContract):
    transport_name = "tensor"
    args = {"shared_memory": False}


def test_tensor_transport_uses_shared_memory_only_for_engines_on_its_host(tmp_path):
    """Embedded engines on loopback or the sender's own address read the segment; others get bytes by value,
    SGLang on this host too (its loader refuses the handles, and its scheduler dies of them)."""
    import asyncio

    from rlx.plugins import build_plugins
    from rlx.transport import TransportContext

    class Engine:
        def __init__(self, url, info):
            self.url, self.info = url, info

        def client(self, timeout_s=None):
            engine = self

            class Client:
                async def __aenter__(self):
                    return self

                async def __aexit__(self, *exc):
                    return None

                async def server_info(self):
                    return engine.info

            return Client()

    embedded, sglang = {"engine": "rlx-embedded", "version": "rlx-embedded-0"}, {"version": "0.5.23"}
    engines = [Engine("http://127.0.0.1:1", embedded), Engine("http://10.0.0.5:2", embedded),
               Engine("http://10.0.0.9:3", embedded), Engine("http://127.0.0.1:4", sglang)]
    plugins = build_plugins(entry_points=False)
    for args, local in (({}, {"http://127.0.0.1:1", "http://10.0.0.5:2"}), ({"shared_memory": False}, set())):
        t = plugins.build("transports", {"name": "tensor", "args": args})
        asyncio.run(t.setup(TransportContext(engines, tmp_path, host="10.0.0.5")))
        assert t.local == local and (t.segment is not None) == bool(local)
        asyncio.run(t.close())


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


def test_an_engine_that_cannot_read_shared_memory_gets_tensors_by_value_from_then_on(tmp_path):
    """An engine on this host whose /dev/shm is its own (a container) refuses the handles: the bucket goes again
    by value, and so does every later one to that engine."""
    import asyncio

    import torch

    from rlx.plugins import build_plugins
    from rlx.rollout.engines.client import EngineError
    from rlx.transport import TransportContext
    from rlx.transport.payloads import deserialize_named_tensors

    got, versions = [], []

    class Client:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def begin_weight_update(self):
            return False

        async def update_weights_from_tensor(self, payloads, weight_version=None):
            if len(payloads[0]) < 5000:  # handles, not bytes
                raise EngineError("Failed to update weights: shared-memory segment ... is not on this engine's host")
            got.append(deserialize_named_tensors(payloads[0]))
            versions.append(weight_version)

        async def update_weight_version(self, version):
            versions.append(f"commit {version}")

        async def server_info(self):
            return {"engine": "rlx-embedded"}

    class Engine:
        url = "http://127.0.0.1:1"

        def client(self, timeout_s=None):
            return Client()

    t = build_plugins(entry_points=False).build("transports", {"name": "tensor", "args": {"bucket_mb": 1}})
    ctx = TransportContext([Engine()], tmp_path)
    named = [(f"w{i}", torch.full((200_000,), float(i))) for i in range(3)]  # 0.8 MB each: a bucket each

    async def push():
        await t.setup(ctx)
        assert t.local == {Engine.url}
        await t.send(iter(named), 1, ctx)
        await t.commit(1, ctx)
        await t.close()

    asyncio.run(push())
    assert t.local == set() and [[(n, v[0].item()) for n, v in b] for b in got] == [[("w0", 0.0)], [("w1", 1.0)],
                                                                                     [("w2", 2.0)]]
    # the only sender sets the version with its last bucket, and the commit then has nothing left to do
    assert versions == [None, None, "1"]
