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
