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


def test_the_gpu_walkthrough_reward_and_config_work_as_written(tmp_path):
    """docs/guides/gpu.md: its reward plugin scores in a reward worker, and its config validates (Qwen3-8B's shape
    standing in for the checkpoint, which no machine here has)."""
    import json

    from rlx.config import load_config
    from rlx.preflight import config_checks

    guide = (Path(__file__).parents[2] / "docs" / "guides" / "gpu.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", guide, re.S) if "register_rewards" in b)
    mod = types.ModuleType("my_reward")
    exec(compile(code, "gpu.md", "exec"), mod.__dict__)
    p = build_plugins(extra=[("my_reward", mod)])
    rewards = Rewards([RewardSpec(name="boxed_answer")], p, RolloutConfig())
    for response, want in [("so \\boxed{7}", 1.0), ("\\boxed{6} then \\boxed{7}", 1.0), ("7", 0.0)]:
        assert asyncio.run(rewards.score(Sample([1], response_text=response, label="7"))).reward == want, response

    config = re.findall(r"```yaml\n(.*?)```", guide[guide.index("## The config"):], re.S)[0]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_attention_heads": 32,
                                                             "num_key_value_heads": 8, "num_hidden_layers": 36}))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    for a, b in (("/models/Qwen3-8B", "m"), ("/data/my-prompts.jsonl", "p.jsonl"),
                 ("/data/my-heldout.jsonl", "p.jsonl"), ("/shared/runs", "runs")):
        config = config.replace(a, b)
    (tmp_path / "c.yaml").write_text(config)
    cfg = load_config(tmp_path / "c.yaml", checks=config_checks(p, files=True))
    assert cfg.train.parallel.world_size == cfg.rollout.engines[0].num_engines * cfg.rollout.engines[0].tp_size == 8
