"""The type checker as CI runs it (mypy, configured in pyproject.toml: strict on the plugin API and the contracts,
standard on the rest): no error in core, the CLI and the plugins; a wrong type in a built-in fails it; and a plugin
that breaks a contract fails its own author's type check and rlx's registration, in the same words."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.errors import PluginError
from rlx.plugins import build_plugins

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration  # mypy runs for a minute or two, cold: scheduled with the long tests

WRONG_PLUGIN = '''\
"""A plugin with two mistakes: a reward that returns a string, a transport without commit and close."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlx import hookimpl
from rlx.hookspecs import RegisterRewards, RegisterTransports
from rlx.protocols import TransportContext
from rlx.types import Sample


class Shout:
    name = "shout"

    def score(self, sample: Sample) -> str:
        return "yes"


class HalfDone:
    name = "half-done"

    async def setup(self, ctx: TransportContext) -> None: ...

    async def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int, ctx: TransportContext) -> None: ...


@hookimpl
def register_rewards(register: RegisterRewards) -> None:
    register(Shout)


@hookimpl
def register_transports(register: RegisterTransports) -> None:
    register(HalfDone)
'''


def mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    exe = shutil.which("mypy", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("mypy is not installed (it is in the test extra: pip install -e '.[test]')")
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd, timeout=900)


def test_core_the_cli_and_the_plugins_type_check_without_an_error():
    r = mypy()
    assert r.returncode == 0 and "Success: no issues found" in r.stdout, r.stdout[-6000:] + r.stderr[-2000:]


def test_a_wrong_type_in_a_builtin_fails_the_check(tmp_path):
    source = ROOT / "core/rlx/builtins/generators.py"
    text = source.read_text()
    wrong = text.replace("            return [sample]\n", "            return sample\n", 1)
    assert wrong != text
    (tmp_path / "generators.py").write_text(wrong)
    r = mypy("--shadow-file", str(source), str(tmp_path / "generators.py"))
    assert r.returncode == 1, r.stdout[-3000:]
    assert 'generators.py:' in r.stdout and \
        'Incompatible return value type (got "Sample", expected "list[Sample]")' in r.stdout, r.stdout[-3000:]


def test_a_plugin_that_breaks_its_contracts_fails_its_type_check_and_registration_alike(tmp_path):
    (tmp_path / "wrong_plugin.py").write_text(WRONG_PLUGIN)
    # the plugin's own CI: rlx installed, none of rlx's configuration
    r = mypy("--cache-dir", str(tmp_path / "cache"), "wrong_plugin.py", cwd=tmp_path)
    out = r.stdout
    assert r.returncode == 1 and "Found 2 errors in 1 file" in out, out[-4000:]
    assert 'incompatible type "type[Shout]"' in out and "def score(self: Shout, sample: Sample) -> str" in out
    assert '"HalfDone" is missing following "Transport" protocol members:' in out and "close, commit" in out

    spec = importlib.util.spec_from_file_location("wrong_plugin", tmp_path / "wrong_plugin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(PluginError) as e:
        build_plugins(entry_points=False, extra=[("wrong", module)])
    said = str(e.value)
    assert "'half-done'" in said and 'is missing the "Transport" protocol member commit' in said, said
    assert 'is missing the "Transport" protocol member close' in said, said
