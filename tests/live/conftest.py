"""The live-SGLang tier: real SGLang 0.5.23 servers on this machine's CPU, from the environment that
scripts/sglang-cpu-env makes (its interpreter: RLX_SGLANG_PYTHON, else the repository's .sglang-cpu link).
Without it every test here is skipped with that reason; .ci/run makes it, so CI runs them."""

import asyncio
import os
from pathlib import Path

import pytest

from rlx.rollout.engines.launch import (HOST, NO_AMX_ENV, ManagedProcess, free_port, sglang_command, sglang_cpu_args,
                                        wait_healthy)

ROOT = Path(__file__).resolve().parents[2]


def sglang_python() -> str | None:
    given = os.environ.get("RLX_SGLANG_PYTHON")
    if given:
        return given
    link = ROOT / ".sglang-cpu" / "bin" / "python"
    return str(link) if link.exists() else None


def pytest_collection_modifyitems(config, items):
    if sglang_python() is not None:
        return
    skip = pytest.mark.skip(reason="no SGLang CPU environment: scripts/sglang-cpu-env makes one (.ci/run does)")
    for item in items:
        if "tests/live/" in str(item.path):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sglang_py() -> str:
    return sglang_python()


def start_sglang(python: str, model_path: str, log: Path, **server_args) -> tuple[ManagedProcess, str]:
    """A live SGLang server on a CPU, as rlx launches one (`sglang_cpu_args`), healthy; the caller stops it."""
    port = free_port()
    args = sglang_cpu_args(model_path, requests=16, new_tokens=64, engines=1) | {"dtype": "float32"} | server_args
    proc = ManagedProcess(sglang_command(model_path, port, server_args=args, python=python), log)
    proc.start({"SGLANG_USE_CPU_ENGINE": "1", NO_AMX_ENV: "1"})  # fp32 (see NO_AMX_ENV)
    url = f"http://{HOST}:{port}"
    try:
        asyncio.run(wait_healthy(url, proc, 300, what="SGLang"))
    except BaseException:
        proc.stop()
        raise
    return proc, url


@pytest.fixture(scope="session")
def sglang_launcher():
    """`start_sglang`, for a test that needs a server of its own (another model); the test stops it."""
    return start_sglang


@pytest.fixture(scope="session")
def sglang_server(sglang_py, tiny_model_path, tmp_path_factory):
    """One live SGLang server on the tiny model for the tier (a start costs 20-30 s), stopped (its process
    group) after it; a test that changes its weights loads the tiny model's back before it ends."""
    proc, url = start_sglang(sglang_py, tiny_model_path, tmp_path_factory.mktemp("sglang") / "server.log")
    try:
        yield url
    finally:
        proc.stop()
