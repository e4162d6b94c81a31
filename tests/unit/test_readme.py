"""The README's plugin example is code that works, not prose that drifts."""

import re
import types
from pathlib import Path

from rlx.plugins import build_plugins
from rlx.types import Sample

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_write_a_plugin_example_registers_and_scores():
    code = next(b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "register_rewards" in b)
    mod = types.ModuleType("rlx_reward_length")
    exec(compile(code, "README.md", "exec"), mod.__dict__)
    p = build_plugins(entry_points=False, extra=[("length", mod)])
    reward = p.build("rewards", {"name": "length", "args": {"target": 10}})
    assert reward.score(Sample([1], response_text="x" * 10)).score == 1.0
    assert reward.score(Sample([1], response_text="x" * 5)).score == 0.5


def test_quickstart_has_exactly_two_commands_and_ci_runs_the_second():
    quick = README[README.index("## Quickstart"):]
    blocks = re.findall(r"```[^\n]*\n(.*?)```", quick, re.S)
    assert blocks[0].strip() == "scripts/setup && scripts/loopback .venv/bin/rl train examples/quickstart.yaml"
    assert blocks[1].strip() == "scripts/test"
    ci = (Path(__file__).parents[2] / ".ci" / "run").read_text()
    assert "scripts/test" in ci
