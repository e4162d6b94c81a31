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
            reads = await box.run(["cat"], timeout_s=5)  # stdin is closed: a reader sees its end at once
            return box.root, r, made, box.read("out.txt"), reads

    root, r, made, out, reads = run(go())
    assert r.ok and r.stdout == "hello" and made.ok and out == "x"
    assert reads.ok and reads.stdout == "" and not reads.timed_out
    assert not root.exists()


def test_the_time_limit_kills_the_whole_process_group():
    async def go():
        async with Sandbox(time_limit_s=0.5) as box:
            return await box.run(["sh", "-c", "sleep 30 & sleep 30"])

    r = run(go())
    assert r.timed_out and r.returncode is None and r.seconds < 5


def test_a_cancelled_run_leaves_no_process_behind():
    """The caller's own time limit (the agent generator's) cancels a run: the command and its children go."""
    import os
    import subprocess
    import uuid

    marker = f"{30 + uuid.uuid4().int % 1000 / 1000:.3f}"  # a sleep no other process runs

    async def go():
        async with Sandbox(time_limit_s=60) as box:
            await asyncio.wait_for(box.run(["sh", "-c", f"sleep {marker} & sleep {marker}"]), 1.0)

    with pytest.raises(asyncio.TimeoutError):
        run(go())
    left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout.split()
    assert [p for p in left if int(p) != os.getpid()] == []


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


ESCAPES = """
import json, os
out = {}
for name, path in (("secret", SECRET), ("project", PROJECT), ("home", os.path.expanduser("~root/.bashrc"))):
    try:
        open(path).read()
        out[name] = "read"
    except OSError as e:
        out[name] = type(e).__name__
for name, path in (("host_tmp", WRITE), ("usr", "/usr/rlx-sandbox-escape"), ("python", PYDIR + "/rlx-escape")):
    try:
        open(path, "w").write("x")
        out["write_" + name] = "written"
    except OSError as e:
        out["write_" + name] = type(e).__name__
open("mine.txt", "w").write("ok")
out["cwd"] = os.getcwd()
print(json.dumps(out))
"""


def test_files_outside_the_task_folder_can_be_neither_read_nor_written(tmp_path):
    """Inside: the task folder read-write at /task, the toolchain read-only, nothing else (a secret beside the
    sandbox, the project's files, a home folder). Without file isolation the same probe reads the secret and
    writes beside it, so the test can fail."""
    import json
    import os
    from pathlib import Path

    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    probe = (f"SECRET, PROJECT, WRITE, PYDIR = {str(secret)!r}, {str(Path(__file__).resolve())!r}, "
             f"{str(tmp_path / 'written.txt')!r}, {sys.prefix!r}\n" + ESCAPES)

    async def go(isolate):
        async with Sandbox(isolate_files=isolate) as box:
            r = await box.run([sys.executable, "-c", probe])
            return r, box.read("mine.txt") if r.ok else None

    (inside, mine) = run(go(True))
    assert inside.ok, inside.stderr
    got = json.loads(inside.stdout)
    assert got["secret"] == got["project"] == got["home"] == "FileNotFoundError", got
    assert all(got[k] != "written" for k in ("write_host_tmp", "write_usr", "write_python")), got
    assert not (tmp_path / "written.txt").exists() and got["cwd"] == "/task" and mine == "ok"
    (outside, _) = run(go(False))
    assert json.loads(outside.stdout)["secret"] == "read" and (tmp_path / "written.txt").read_text() == "x"
    os.unlink(tmp_path / "written.txt")


def test_a_program_outside_the_toolchain_is_refused_unless_its_folder_is_added(tmp_path):
    tool = tmp_path / "tools" / "hello"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho hello from $(pwd)\n")
    tool.chmod(0o755)

    async def go(**kw):
        async with Sandbox(**kw) as box:
            return await box.run([str(tool)])

    with pytest.raises(SandboxError, match="outside the sandbox's toolchain"):
        run(go())
    r = run(go(toolchain=(str(tool.parent),)))
    assert r.ok and r.stdout == "hello from /task\n"


def _echo_server():
    """A host TCP server on loopback answering each connection's first line with 'echo: <line>'."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"echo: " + conn.recv(100))

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_only_the_addresses_it_may_reach_are_reachable():
    """With `reach` (the agent adapter's address, say) a sandboxed command connects there, on its own loopback,
    and to nothing else: another server on the same host loopback stays out of reach; with files isolated too."""
    allowed, other = _echo_server(), _echo_server()
    a, o = allowed.getsockname()[1], other.getsockname()[1]
    probe = ("import socket, sys\n"
             "for port in map(int, sys.argv[1:]):\n"
             "    try:\n"
             "        c = socket.create_connection(('127.0.0.1', port), timeout=3)\n"
             "        c.sendall(b'hi'); print(port, c.recv(100).decode())\n"
             "    except OSError as e:\n"
             "        print(port, 'refused', type(e).__name__)\n")

    async def go(**kw):
        async with Sandbox(reach=(("127.0.0.1", a),), **kw) as box:
            first = await box.run([sys.executable, "-c", probe, str(a), str(o)])
            again = await box.run([sys.executable, "-c", probe, str(a)])  # the bridge serves every run
            return first, again

    try:
        for kw in ({}, {"isolate_files": False}):
            first, again = run(go(**kw))
            assert first.ok, first.stderr
            lines = first.stdout.splitlines()
            assert lines[0] == f"{a} echo: hi" and lines[1].startswith(f"{o} refused"), (kw, lines)
            assert again.stdout == f"{a} echo: hi\n"
    finally:
        allowed.close()
        other.close()
    with pytest.raises(SandboxError, match="not a loopback address"):
        Sandbox(reach=(("10.0.0.1", 80),))


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
