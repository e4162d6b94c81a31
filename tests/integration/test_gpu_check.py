"""scripts/gpu-check on this CPU machine: the dry run shows the whole plan and runs nothing; and the checks that can
run on a CPU (``--cpu``: the same code, small sizes) pass here, so that a rare GPU session is not lost to a bug in a
check. What a GPU would measure is not asserted here."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import check  # noqa: E402

pytestmark = pytest.mark.integration


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "scripts" / "gpu-check"), *args], capture_output=True, text=True, timeout=600)


def test_the_dry_run_shows_every_check_and_runs_none(tmp_path):
    r = gpu_check("--out", str(tmp_path), "--dry-run")
    assert r.returncode == 0, r.stderr
    table = (tmp_path / "gpu-check.md").read_text()
    assert "--dry-run: nothing ran" in table and f"Limits sum to {sum(c.limit_s for c in check.PLAN)} s" in table
    for c in check.PLAN:
        row = next(line for line in table.splitlines() if line.startswith(f"| {c.name} |"))
        assert "| would run |" in row or "| skipped: " in row and "is not installed" in row, row
    assert not list((tmp_path / "logs").iterdir()) and not list(tmp_path.glob("*.json"))


def test_the_checks_that_run_on_a_cpu_pass_here(tmp_path):
    names = ["environment", "transport", "rl-train", "speculative", "offload", "throughput"]
    r = gpu_check("--out", str(tmp_path), "--cpu", "--only", *names)
    table = (tmp_path / "gpu-check.md").read_text()
    assert r.returncode == 0, table + r.stderr
    for name in names:
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert "| pass |" in row, row
    assert "held_between_steps_gib_with 0.0" in table and "offload_reward_last3" in table


def test_an_unknown_check_is_refused():
    r = gpu_check("--out", "/tmp/unused", "--only", "nope")
    assert r.returncode == 2 and "no check named ['nope']" in r.stderr
