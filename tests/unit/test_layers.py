"""The import layering of `.importlinter` holds (import-linter's own checker, as CI runs it): the CLI on top, the
contracts and types at the bottom, and no circles between the modules of any package."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_layers_hold_and_nothing_imports_in_a_circle():
    linter = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if linter is None:
        pytest.skip("import-linter is not installed (it is in the test extra: pip install -e '.[test]')")
    r = subprocess.run([linter, str(ROOT / ".importlinter")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "4 kept, 0 broken" in r.stdout
