"""Parallel worlds for tests, forked from a warm interpreter instead of started by torchrun.

A rank of a test's parallel world spends about 5 s of CPU importing torch, megatron-core and transformers before
its half second of work: a 4-rank world under torchrun took 16 s on a 2-core machine. `world()` forks the ranks
from one process per test session that has imported them already (``python -m rlx.testing.warm``), each with the
environment torchrun gives (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), and returns what ``subprocess.run(..., capture_output=True)`` would: the same world in 2-4 s.

Each rank runs ``python SCRIPT ARGS`` (`runpy`, as ``__main__``) with the caller's environment and working
directory, its output to files the caller reads back. As under torchrun, one rank failing ends the others; every
rank still running at the timeout is killed by its PID; and each dies with the warm process
(``PR_SET_PDEATHSIG``), which ends with the test session or when its caller goes away. The warm process has
imported what a trainer rank imports, so tests of what an import does (megatron's patches) keep fresh processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ("rlx.train", "rlx.train.trainer", "rlx.config", "transformers")

_server: subprocess.Popen[str] | None = None


def world(script: str | Path, args: list[str], nproc: int, *, env: dict[str, str] | None = None,
          timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `script` `args` as the ranks of an `nproc`-process world (stdout and stderr of every rank, in rank
    order). Raises ``subprocess.TimeoutExpired`` as ``subprocess.run`` does."""
    from rlx.net import free_port

    global _server
    started = _server is None or _server.poll() is not None
    if _server is None or started:
        env0 = {k: v for k, v in os.environ.items() if k != "RLX_TEST_ID"}  # it outlives the test that starts it
        _server = subprocess.Popen([sys.executable, "-m", "rlx.testing.warm"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   env={**env0, "OMP_NUM_THREADS": "1"})
    to, back = _server.stdin, _server.stdout
    assert to is not None and back is not None  # made with pipes
    if started and back.readline().strip() != "ready":
        raise RuntimeError(f"rlx.testing.warm did not start (exit {_server.wait()}): run it by hand to see why")
    with tempfile.TemporaryDirectory() as out:
        request = dict(script=str(script), args=list(map(str, args)), nproc=nproc, out=out, timeout=timeout,
                       cwd=os.getcwd(), env={**os.environ, **(env or {})}, port=free_port("127.0.0.1"))
        to.write(json.dumps(request) + "\n")
        to.flush()
        reply = json.loads(back.readline() or '{"code": null}')
        if reply["code"] is None:
            raise RuntimeError("rlx.testing.warm died while running a world")
        files = [Path(out) / f"{r}.{k}" for k in ("out", "err") for r in range(nproc)]
        # a rank killed before it began (another failed first) has written nothing
        text = [f.read_text(errors="replace") if f.exists() else "" for f in files]
    command = [sys.executable, str(script), *map(str, args)]
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(command, timeout, "".join(text[:nproc]), "".join(text[nproc:]))
    return subprocess.CompletedProcess(command, reply["code"], "".join(text[:nproc]), "".join(text[nproc:]))


def close() -> None:
    """End the warm process (its end of the pipe closes; it exits), if one was started."""
    global _server
    if _server is not None:
        if _server.stdin is not None:
            _server.stdin.close()
        try:
            _server.wait(10)
        except subprocess.TimeoutExpired:
            _server.kill()
            _server.wait()
        _server = None


def _rank(request: dict, rank: int) -> None:
    """In the forked child: become rank `rank` of the request's world, run its script, exit."""
    import ctypes
    import runpy
    import signal
    import traceback

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the warm process
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the requests are the warm process's, not the rank's
    for fd, kind in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{request['out']}/{rank}.{kind}", os.O_WRONLY | os.O_CREAT, 0o644), fd)
    os.chdir(request["cwd"])
    n = str(request["nproc"])
    os.environ.clear()
    os.environ.update(request["env"], RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=n, LOCAL_WORLD_SIZE=n,
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]))
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
    code = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as e:  # as the interpreter does: a message is printed, and exits 1
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(request: dict) -> dict:
    import select
    import signal
    import time

    pids = []
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank(request, rank)
        pids.append(pid)
    fds = {os.pidfd_open(pid): pid for pid in pids}
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    while len(codes) < len(pids) and (left := deadline - time.monotonic()) > 0:
        for fd in select.select([fd for fd, pid in fds.items() if pid not in codes], [], [], left)[0]:
            codes[fds[fd]] = os.waitstatus_to_exitcode(os.waitpid(fds[fd], 0)[1])
        if any(codes.values()):  # as torchrun: one rank failed, the others would wait for it forever
            break
    failed = next((c for c in codes.values() if c != 0), 0)  # the rank that failed first, by itself
    for pid in pids:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    for fd in fds:
        os.close(fd)
    return {"code": failed, "timed_out": len(codes) < len(pids) and not failed}


def _serve() -> None:
    import importlib
    import warnings

    warnings.filterwarnings("ignore")  # megatron's "Transformer Engine is not installed", once per session
    for name in PRELOAD:
        importlib.import_module(name)
    from rlx.plugins import build_plugins

    build_plugins()  # imports the installed model plugins' modules
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(_run(json.loads(line))), flush=True)


if __name__ == "__main__":
    _serve()
