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

    real = plugins.build_plugins
    monkeypatch.setattr(plugins, "build_plugins", lambda **kw: real(extra=[("agents-plugin", mod)]))
    assert load_function("echo_agent").__qualname__.endswith("Registered.run")


def test_the_policys_maximum_output_per_call_is_the_rollouts_max_new_tokens(tmp_path, tiny_model_path):
    """What a harness asks per call (Claude Code: 32,000 tokens) is bounded by rollout.sampling.max_new_tokens."""
    import asyncio

    from transformers import AutoTokenizer

    from rlx.builtins.agents import AgentArgs, AgentGenerator
    from rlx.config import SamplingConfig
    from rlx.rollout.context import GenerateContext

    f = tmp_path / "a.py"
    f.write_text("async def agent(base_url, api_key, task):\n    return 1.0\n")
    gen = AgentGenerator(AgentArgs(function=f"{f}:agent"))
    ctx = GenerateContext(None, AutoTokenizer.from_pretrained(tiny_model_path), SamplingConfig(max_new_tokens=48))

    async def adapter():
        a = await gen._adapter(ctx)
        await a.stop()
        return a

    assert asyncio.run(adapter()).max_output_tokens == 48


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

    real = plugins.build_plugins
    monkeypatch.setattr(plugins, "build_plugins", lambda **kw: real(extra=[("agents-plugin", mod)]))
    assert load_function("configured_agent", {"turns": 3}).__self__.config.turns == 3
    with pytest.raises(RLXError, match=r"agent_args \(agent 'configured_agent'\): turnz: Extra inputs"):
        load_function("configured_agent", {"turnz": 3})
    f = tmp_path / "a.py"
    f.write_text("async def agent(base_url, api_key, task):\n    return 1.0\n")
    with pytest.raises(RLXError, match="takes no agent_args"):
        load_function(f"{f}:agent", {"turns": 3})
