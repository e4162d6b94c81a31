"""A plugin written outside the repo, with its own pyproject and entry point, installed by real pip
into a scratch virtualenv, is discovered, listed, selected by config and gone once uninstalled."""

import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

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


def test_install_list_use_uninstall(tmp_path, scratch_venv):
    src = tmp_path / "rlx-reward-length"
    (src / "rlx_reward_length").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "rlx_reward_length" / "__init__.py").write_text(MODULE)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(textwrap.dedent("""
        model: {path: /m}
        rollout:
          rewards: [length]
    """))
    rl = ["-m", "rlx_cli.main"]

    r = run(scratch_venv, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", str(src))
    assert r.returncode == 0, r.stderr

    r = run(scratch_venv, *rl, "plugins", "--json")
    assert r.returncode == 0, r.stderr
    row = next(p for p in json.loads(r.stdout) if p["name"] == "length")
    assert row == {"name": "length", "distribution": "rlx-reward-length", "version": "0.3.0",
                   "registers": {"rewards": ["length"]}}

    r = run(scratch_venv, *rl, "config", "show", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "name: length" in r.stdout

    r = run(scratch_venv, "-m", "pip", "uninstall", "-y", "rlx-reward-length")
    assert r.returncode == 0, r.stderr
    r = run(scratch_venv, *rl, "plugins", "--json")
    assert "length" not in [p["name"] for p in json.loads(r.stdout)]
    r = run(scratch_venv, *rl, "config", "validate", str(cfg))
    assert r.returncode == 2 and "no reward named 'length'" in r.stderr
