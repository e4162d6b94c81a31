"""pytest plugin (entry point ``pytest11``): fixtures for testing rlx plugins, and the suite's hygiene.

Every process a test starts inherits ``RLX_TEST_ID`` (one value per test); after the test's teardown, any still
alive is killed and named in the terminal summary, so a test that fails (or forgets) leaves nothing behind. The
session does the same for what its fixtures started (``RLX_TEST_SESSION``)."""

from __future__ import annotations

import os
import signal
import uuid

import pytest

_LEFT: list[str] = []  # "test: pid command", for the summary


def pytest_configure(config):
    """Processes the tests start get default signal dispositions: an ignored signal is inherited through exec,
    and a shell ignores SIGINT and SIGQUIT for the jobs it puts in the background (SIGHUP under nohup), so a
    suite run that way would start `rl serve` deaf to the Ctrl-C its tests send. Handled signals reset on exec."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.environ["RLX_TEST_SESSION"] = uuid.uuid4().hex  # a new one in a pytest run by a test: its own sweep


def _sweep(var: str, where: str) -> None:
    """Kill the live processes tagged with this process's ``var`` (after a short grace for those stopping), but
    those this process keeps for its life on purpose (the shared reward workers, `rlx.rollout.rewards`)."""
    import sys

    from rlx.testing.processes import wait_gone

    tag = os.environ.get(var)
    if not tag:
        return
    rewards = sys.modules.get("rlx.rollout.rewards")
    kept = {os.getpid(), *(rewards.shared_worker_pids() if rewards else ())}
    for pid in sorted(wait_gone(tag, 5, var, keep=kept)):
        try:
            command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:160]
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone meanwhile
            continue
        _LEFT.append(f"{where}: pid {pid} {command}")


@pytest.fixture(autouse=True)
def _kill_what_the_test_left():
    from rlx.plugins import reset_process_plugins

    reset_process_plugins()  # each test builds the installed plugins afresh (its environment may differ)
    os.environ["RLX_TEST_ID"] = uuid.uuid4().hex
    yield
    _sweep("RLX_TEST_ID", os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0])
    del os.environ["RLX_TEST_ID"]


@pytest.hookimpl(trylast=True)  # after pytest-xdist's controller has ended its workers
def pytest_sessionfinish(session, exitstatus):
    import sys

    if warm := sys.modules.get("rlx.testing.warm"):
        warm.close()  # the parallel worlds' warm process, which the session keeps on purpose
    _sweep("RLX_TEST_SESSION", "the session's fixtures")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _LEFT:
        terminalreporter.section("processes the tests left behind (killed)")
        for line in _LEFT:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """The built-in tiny model (``builtin://tiny-qwen3``), built once per test session in a private cache
    (``RLX_CACHE`` points there, so engines started by the test build other built-ins there too)."""
    cache = tmp_path_factory.mktemp("rlx-cache")
    os.environ["RLX_CACHE"] = str(cache)  # engine subprocesses inherit it
    from rlx.models.tiny import resolve_model_path

    return resolve_model_path("builtin://tiny-qwen3")


@pytest.fixture(scope="session")
def contract_engine(tiny_model_path, tmp_path_factory):
    """An embedded engine on the built-in tiny model, shared by the session's transport contracts (a start costs
    about 5 s): ``(its URL, the model's folder)``. Each contract test loads the model's own weights back first. It serves
    LoRA adapters (``--enable-lora``), for transports that carry them."""
    import asyncio

    from rlx.rollout.engines.launch import HOST, ManagedProcess, embedded_command, free_port, wait_healthy

    port = free_port()
    proc = ManagedProcess(embedded_command(tiny_model_path, port, server_args={"num_threads": 1, "enable_lora": True}),
                          tmp_path_factory.mktemp("contract-engine") / "engine.log")
    proc.start()
    try:
        url = f"http://{HOST}:{port}"
        asyncio.run(wait_healthy(url, proc, 120))
        yield url, tiny_model_path
    finally:
        proc.stop()


@pytest.fixture
def rlx_plugins():
    """A fresh plugin manager with built-ins and installed entry points."""
    from rlx.plugins import build_plugins

    return build_plugins()
