"""The sandbox's limits, each shown to bite, and the test-based reward through its contract."""

import asyncio
import socket
import sys

import pytest
from rlx_agent_sandbox import Sandbox, SandboxError

from rlx.testing import RewardCase, RewardContract


def run(coro):
    return asyncio.run(coro)


def test_commands_run_in_a_throwaway_directory():
    async def go():
        async with Sandbox(time_limit_s=10) as box:
            box.write("a/b.txt", "hello")
            r = await box.run(["cat", "a/b.txt"])
            made = await box.run([sys.executable, "-c", "open('out.txt', 'w').write('x')"])
            return box.root, r, made, box.read("out.txt")

    root, r, made, out = run(go())
    assert r.ok and r.stdout == "hello" and made.ok and out == "x"
    assert not root.exists()


def test_the_time_limit_kills_the_whole_process_group():
    async def go():
        async with Sandbox(time_limit_s=0.5) as box:
            return await box.run(["sh", "-c", "sleep 30 & sleep 30"])

    r = run(go())
    assert r.timed_out and r.returncode is None and r.seconds < 5


def test_the_memory_limit_stops_a_big_allocation():
    async def go():
        async with Sandbox(memory_mb=256) as box:
            return await box.run([sys.executable, "-c", "x = bytearray(1 << 30); print('allocated')"])

    r = run(go())
    assert r.returncode != 0 and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_there_is_no_network_not_even_this_hosts_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"

    async def go():
        async with Sandbox() as box:
            inside = await box.run([sys.executable, "-c", probe])
        async with Sandbox(network=True) as box:
            outside = await box.run([sys.executable, "-c", probe])
        return inside, outside

    try:
        inside, outside = run(go())
    finally:
        server.close()
    assert inside.returncode != 0 and "connected" not in inside.stdout
    assert outside.ok and "connected" in outside.stdout  # the probe itself works


def test_errors_are_explicit():
    with Sandbox() as box:
        with pytest.raises(SandboxError, match="outside the sandbox"):
            box.write("../escape.txt", "x")
        with pytest.raises(SandboxError, match="not found"):
            run(box.run(["no-such-program-xyz"]))
        with pytest.raises(SandboxError, match="does not exist"):
            box.read("missing.txt")
    with pytest.raises(SandboxError, match="not open"):
        run(Sandbox().run(["true"]))


TESTS = "from solution import add\nassert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


class TestSandboxTestsReward(RewardContract):
    reward_name = "sandbox_tests"
    cases = [
        RewardCase("```python\ndef add(a, b):\n    return a + b\n```", TESTS, 1.0),
        RewardCase("def add(a, b):\n    return a - b\n", TESTS, 0.0),
        RewardCase("```python\nimport time\ndef add(a, b):\n    time.sleep(60)\n```", TESTS, 0.0),
        RewardCase("not code at all", TESTS, 0.0),
    ]
    args = {"time_limit_s": 2}
