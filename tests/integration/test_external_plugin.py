"""A plugin written outside the repo, with its own pyproject and entry point, installed by real pip
into a scratch virtualenv, is discovered, listed, selected by config and gone once uninstalled."""

import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration

PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "rlx-reward-length"
version = "0.3.0"
dependencies = []

[project.entry-points."rlx.plugins"]
length = "rlx_reward_length"
"""

MODULE = '''
from rlx import hookimpl


class Length:
    name = "length"

    def score(self, sample):
        return min(len(sample.response_text) / 100, 1.0)


@hookimpl
def register_rewards(register):
    register(Length)
'''


@pytest.fixture
def scratch_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # See this interpreter's packages (rlx, pip, hatchling) without copying them; installs go to the
    # scratch venv's own site-packages, so uninstalling there does not touch ours.
    site = next((venv / "lib").glob("python3*/site-packages"))
    # addsitedir (not a bare path) so that editable installs' own .pth files are honoured too.
    (site / "parent.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return venv / "bin" / "python"


def run(py, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLX_")}
    return subprocess.run([str(py), *args], capture_output=True, text=True, env=env, timeout=300)


def install(py, tmp_path, dist: str, entry: str, code: str) -> None:
    """pip-install a one-module plugin distribution `dist` (module `rlx_<...>`, entry point `entry`) into `py`'s
    venv, from a source folder as its author would have it."""
    module = dist.replace("-", "_")
    src = tmp_path / dist
    (src / module).mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT.replace("rlx-reward-length", dist)
                                        .replace('length = "rlx_reward_length"', f'{entry} = "{module}"'))
    (src / module / "__init__.py").write_text(code)
    r = run(py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", str(src))
    assert r.returncode == 0, r.stderr


def test_install_list_use_uninstall(tmp_path, scratch_venv):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(textwrap.dedent("""
        model: {path: /m}
        rollout:
          rewards: [length]
    """))
    rl = ["-m", "rlx_cli.main"]

    install(scratch_venv, tmp_path, "rlx-reward-length", "length", MODULE)

    r = run(scratch_venv, *rl, "plugins", "--json")
    assert r.returncode == 0, r.stderr
    row = next(p for p in json.loads(r.stdout) if p["name"] == "length")
    assert row == {"name": "length", "distribution": "rlx-reward-length", "version": "0.3.0",
                   "registers": {"rewards": ["length"]}, "error": None}

    r = run(scratch_venv, *rl, "config", "show", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "name: length" in r.stdout

    r = run(scratch_venv, "-m", "pip", "uninstall", "-y", "rlx-reward-length")
    assert r.returncode == 0, r.stderr
    r = run(scratch_venv, *rl, "plugins", "--json")
    assert "length" not in [p["name"] for p in json.loads(r.stdout)]
    r = run(scratch_venv, *rl, "config", "validate", str(cfg))
    assert r.returncode == 2 and "no reward named 'length'" in r.stderr


DEMO = Path(__file__).parent / "external" / "rlx-demo-extras"

BROKEN = '''
from rlx import hookimpl


class HalfDone:
    name = "half-done"

    async def setup(self, ctx): ...
    async def send(self, named, version, ctx): ...
    async def close(self): ...


@hookimpl
def register_transports(register):
    register(HalfDone)
'''


def phi3_with_tokenizer(folder: Path, tiny_model_path: str) -> Path:
    """A tiny random Phi-3 checkpoint (a family rlx itself has no bridge for) with the tiny tokenizer."""
    import json as _json
    import shutil

    sys.path.insert(0, str(DEMO))
    try:
        from contracts_check import make_phi3
    finally:
        sys.path.remove(str(DEMO))
    make_phi3(folder)
    tiny = _json.loads((Path(tiny_model_path) / "config.json").read_text())
    cfg = _json.loads((folder / "config.json").read_text())
    cfg.update(eos_token_id=tiny["eos_token_id"], pad_token_id=tiny["pad_token_id"], bos_token_id=None)
    (folder / "config.json").write_text(_json.dumps(cfg))
    (folder / "generation_config.json").unlink(missing_ok=True)
    for f in Path(tiny_model_path).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, folder / f.name)
    return folder


def test_a_bridge_a_transport_and_a_loss_from_outside_work_with_no_change_to_rlx(tmp_path, scratch_venv,
                                                                                 tiny_model_path):
    import shutil

    src = tmp_path / "rlx-demo-extras"
    shutil.copytree(DEMO, src)
    r = run(scratch_venv, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", str(src))
    assert r.returncode == 0, r.stderr
    r = run(scratch_venv, "-m", "rlx_cli.main", "plugins", "--json")
    row = next(p for p in json.loads(r.stdout) if p["name"] == "demo-extras")
    assert row["registers"] == {"losses": ["vanilla_pg"], "transports": ["one-by-one"], "models": ["phi3"]}

    # the plugin's own tests: rlx's contract suites, through the installed entry point
    r = run(scratch_venv, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(src / "contracts_check.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-500:]
    # skipped: only the adapter push, which its transport does not say it carries
    skips = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) == 1 and "'one-by-one' does not carry LoRA adapters" in skips[0], r.stdout[-800:]

    # and a run that trains a Phi-3 with them: its own bridge, its loss, its transport
    model = phi3_with_tokenizer(tmp_path / "phi3", tiny_model_path)
    cfg = small_run_config(tmp_path, "run", model={"path": str(model)}, ray={"enabled": False},
                           train={"num_steps": 2, "objective": {"loss": "vanilla_pg"}},
                           weight_sync={"transport": "one-by-one"})
    r = run(scratch_venv, "-m", "rlx_cli.main", "train", str(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["weight_version"] for x in lines] == [1, 2]


def test_a_component_missing_a_method_fails_at_load_with_one_clear_line(tmp_path, scratch_venv):
    install(scratch_venv, tmp_path, "rlx-demo-broken", "demo-broken", BROKEN)
    # a config that does not use it validates, with a warning naming the plugin and why it was left out
    (tmp_path / "c.yaml").write_text("model: {path: builtin://tiny-qwen3}\n")
    r = run(scratch_venv, "-m", "rlx_cli.main", "config", "validate", str(tmp_path / "c.yaml"))
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: plugin 'demo-broken'"), r.stderr
    assert "'half-done'" in lines[0] and 'is missing the "Transport" protocol member commit: async commit(version, ctx)' in lines[0]
    # one that names what it would provide fails, located, with the plugin's error
    (tmp_path / "c.yaml").write_text("model: {path: builtin://tiny-qwen3}\nweight_sync: {transport: half-done}\n")
    r = run(scratch_venv, "-m", "rlx_cli.main", "config", "validate", str(tmp_path / "c.yaml"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "c.yaml:2: weight_sync.transport.name: no transport named 'half-done'" in r.stderr
    assert "plugin 'demo-broken' (rlx-demo-broken) failed to load and may be the one" in r.stderr
    # rl plugins lists it with that error (JSON for tools), the others loaded, and exits 2
    r = run(scratch_venv, "-m", "rlx_cli.main", "plugins", "--json")
    rows = {p["name"]: p for p in json.loads(r.stdout)}
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert 'is missing the "Transport" protocol member commit: async commit(version, ctx)' in rows["demo-broken"]["error"]
    assert rows["rlx.builtins.rewards"]["error"] is None
    r = run(scratch_venv, "-m", "rlx_cli.main", "plugins")  # piped: a line each, never cut at 80 columns
    line = next(x for x in r.stdout.splitlines() if x.startswith("demo-broken "))
    assert line.startswith("demo-broken (rlx-demo-broken 0.3.0): failed: "), line
    assert line.endswith("async commit(version, ctx), async close()]"), line  # the whole line, not cut


README = (Path(__file__).parents[2] / "README.md").read_text()
README_REWARD = next(b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "register_rewards" in b)
MORE_REWARDS = '''

async def async_close(sample):
    await asyncio.sleep(0)
    return close_answer(sample)


def within(tolerance):
    def reward(sample):
        return float(close_answer(sample) > 0 or tolerance > 10)

    reward.name = f"within_{tolerance}"
    return reward


class Length:
    name = "length"

    def score(self, sample):
        return min(len(sample.response_text) / 100, 1.0)
'''
# the README's module, with an async function, a closure from a factory and a class registered beside its function
USER_REWARDS = ("import asyncio\n" + README_REWARD.replace("    register(close_answer)", "    for r in (close_answer, "
                "async_close, within(1), Length):\n        register(r)") + MORE_REWARDS)


def test_rewards_as_users_write_them_train_from_an_installed_package(tmp_path, scratch_venv):
    """The README's plain-function reward, an async function, a closure from a factory and a class, from a
    pip-installed package, train three steps with the default isolation (sync rewards in reward worker processes)."""
    install(scratch_venv, tmp_path, "rlx-reward-close", "close", USER_REWARDS)
    cfg = small_run_config(tmp_path, "run", ray={"enabled": False},
                           rollout={"rewards": ["close_answer", "async_close", "within_1", "length"]})
    r = run(scratch_venv, "-m", "rlx_cli.main", "train", str(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["rollout/failed"] == 0 for row in rows), rows
