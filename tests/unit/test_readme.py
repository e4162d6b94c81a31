"""The README's plugin example is code that works, not prose that drifts."""

import asyncio
import re
import types
from pathlib import Path

from rlx.config import RewardSpec, RolloutConfig
from rlx.plugins import build_plugins
from rlx.rollout.rewards import Rewards
from rlx.types import Sample

README = (Path(__file__).parents[2] / "README.md").read_text()


def readme_plugin() -> types.ModuleType:
    code = next(b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "register_rewards" in b)
    mod = types.ModuleType("rlx_reward_close")
    exec(compile(code, "README.md", "exec"), mod.__dict__)
    return mod


def test_write_a_plugin_example_scores_in_a_reward_worker_process():
    """The README's reward, scored where a run scores it by default: pickled into a worker process."""
    p = build_plugins(entry_points=False, extra=[("close", readme_plugin())])
    rewards = Rewards([RewardSpec(name="close_answer")], p, RolloutConfig())
    for response, label, want in [("42", "42", 1.0), ("41 ", 42, 0.5), ("40", "42", 0.0), ("x", "42", 0.0),
                                  ("1", None, 0.0)]:
        s = asyncio.run(rewards.score(Sample([1], response_text=response, label=label)))
        assert s.reward == want, (response, label, s.error)


def test_write_a_plugin_contract_example_passes_as_written():
    code = next(b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "RewardContract)" in b)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    suite = next(v for k, v in ns.items() if k.startswith("Test"))
    suite.plugin = readme_plugin()  # as installed (its entry point) in the author's own tests
    case = suite()
    for name in dir(case):
        if name.startswith("test_"):
            getattr(case, name)()


def test_quickstart_has_exactly_two_commands_and_ci_runs_the_second():
    quick = README[README.index("## Quickstart"):]
    blocks = re.findall(r"```[^\n]*\n(.*?)```", quick, re.S)
    assert blocks[0].strip() == "scripts/setup && scripts/loopback .venv/bin/rl train examples/quickstart.yaml"
    assert blocks[1].strip() == "scripts/test"
    ci = (Path(__file__).parents[2] / ".ci" / "run").read_text()
    assert "scripts/test" in ci
