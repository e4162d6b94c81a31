"""The agent generator's loading rules: module:name, file.py:name, registered agents, clear errors."""

import types

import pytest

from rlx import hookimpl
from rlx.builtins.agents import load_function
from rlx.errors import RLXError


def test_functions_load_from_files_and_registered_agents(tmp_path, monkeypatch):
    f = tmp_path / "my_agent.py"
    f.write_text("async def agent(base_url, api_key, task):\n    return 1.0\n\ndef sync(b, k, t):\n    return 0\n")
    assert load_function(f"{f}:agent").__name__ == "agent"
    with pytest.raises(RLXError, match="must be an async function"):
        load_function(f"{f}:sync")
    with pytest.raises(RLXError, match="cannot load"):
        load_function(f"{tmp_path / 'missing.py'}:agent")
    with pytest.raises(RLXError, match="neither module:name"):
        load_function("no_such_agent")

    class Registered:
        name = "echo_agent"

        async def run(self, base_url, api_key, task):
            return 0.5

    mod = types.ModuleType("agents-plugin")
    mod.register_agents = hookimpl(lambda register: register(Registered))
    import rlx.plugins as plugins

    monkeypatch.setattr(plugins, "process_plugins", lambda: plugins.build_plugins(extra=[("agents-plugin", mod)]))
    assert load_function("echo_agent").__qualname__.endswith("Registered.run")


def test_each_sample_calls_with_its_own_context_and_maximum_output(tmp_path, tiny_model_path):
    """What a harness asks per call (Claude Code: 32,000 tokens) is bounded by the max_new_tokens of the context
    the sample was generated in (training, or each evaluation dataset's own), and that context generates."""
    import asyncio

    from transformers import AutoTokenizer

    from rlx.builtins.agents import AgentArgs, AgentGenerator
    from rlx.config import SamplingConfig
    from rlx.rollout.context import GenerateContext
    from rlx.types import Sample

    seen = []

    class Engine:
        def __init__(self, name):
            self.name = name

        async def generate(self, req, retries=0):
            from rlx.rollout.engines.client import GenerateResult

            seen.append((self.name, req.sampling_params["max_new_tokens"], req.sampling_params["temperature"]))
            return [GenerateResult(text="", output_ids=[5, 6], output_logprobs=[-1.0] * 2, finish_reason="length",
                                   matched_stop=None, weight_version="0", token_weight_versions=[], prompt_tokens=0,
                                   rid=req.rid, raw={})]

    f = tmp_path / "a.py"
    f.write_text("import anthropic\n\nasync def agent(base_url, api_key, task):\n"
                 "    c = anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0)\n"
                 "    await c.messages.create(model='m', max_tokens=9000, messages=[{'role': 'user', 'content': 'hi'}])\n"
                 "    return 1.0\n")
    gen = AgentGenerator(AgentArgs(function=f"{f}:agent"))
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    train = GenerateContext(Engine("train"), tok, SamplingConfig(max_new_tokens=48, temperature=1.0))
    evals = GenerateContext(Engine("eval"), tok, SamplingConfig(max_new_tokens=12, temperature=0.0))

    async def run():
        for ctx in (train, evals, train):
            out = await gen.generate(ctx, Sample([1], [], sample_id=0))
            assert out[0].reward == 1.0, out[0].error
        await gen.adapter.stop()

    asyncio.run(run())
    assert seen == [("train", 48, 1.0), ("eval", 12, 0.0), ("train", 48, 1.0)]


def test_a_registered_agent_gets_its_agent_args_checked_against_its_config(monkeypatch, tmp_path):
    from pydantic import BaseModel, ConfigDict

    class Configured:
        name = "configured_agent"

        class Config(BaseModel):
            model_config = ConfigDict(extra="forbid")
            turns: int = 1

        def __init__(self, config):
            self.config = config

        async def run(self, base_url, api_key, task):
            return float(self.config.turns)

    mod = types.ModuleType("agents-plugin")
    mod.register_agents = hookimpl(lambda register: register(Configured))
    import rlx.plugins as plugins

    monkeypatch.setattr(plugins, "process_plugins", lambda: plugins.build_plugins(extra=[("agents-plugin", mod)]))
    assert load_function("configured_agent", {"turns": 3}).__self__.config.turns == 3
    with pytest.raises(RLXError, match=r"agent_args \(agent 'configured_agent'\): turnz: Extra inputs"):
        load_function("configured_agent", {"turnz": 3})
    f = tmp_path / "a.py"
    f.write_text("async def agent(base_url, api_key, task):\n    return 1.0\n")
    with pytest.raises(RLXError, match="takes no agent_args"):
        load_function(f"{f}:agent", {"turns": 3})
