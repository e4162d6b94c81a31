"""Throwaway sandboxes for agent tools and test-based rewards: a temporary directory, a time limit, a
memory limit, no network (a Linux network namespace) and no files but the task's own and a read-only toolchain
(a mount namespace whose root is a fresh tmpfs: the task folder read-write at ``/task``, the system's programs
and libraries and this Python read-only, nothing else; ``isolate_files``)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl
from rlx.hookspecs import RegisterRewards
from rlx.types import RewardResult, Sample

__all__ = ["Result", "Sandbox", "SandboxError", "SandboxTests"]


class SandboxError(Exception):
    """The sandbox itself could not do what was asked (not: the program inside failed)."""


@dataclass
class Result:
    returncode: int | None  # None when killed for the time limit
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@lru_cache(maxsize=4)
def namespace_prefix(network: bool = False, files: bool = False) -> tuple[str, ...] | None:
    """The command prefix that gives a process an empty network namespace (unless `network`) and, with `files`,
    its own mount and process namespaces, as root or through an unprivileged user namespace; None where
    neither works."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    flags = ([] if network else ["-n"]) + (["-m", "-p", "-f", "--mount-proc"] if files else [])
    for user in ([], ["-r"]):
        prefix = (unshare, *user, *flags)
        try:
            r = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return prefix
    return None


def netns_prefix() -> tuple[str, ...] | None:
    """The command prefix that gives a process an empty network namespace here, or None."""
    return namespace_prefix(network=False, files=False)


# Read-only inside an isolated sandbox: the system's programs and libraries, this Python, and the dynamic
# loader's cache (not the rest of /etc, nor home folders, nor the project).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
TASK_DIR = "/task"  # where the task folder is inside an isolated sandbox


def toolchain_paths(extra: tuple[str, ...] = ()) -> list[str]:
    """The paths an isolated sandbox shows read-only: `SYSTEM_PATHS`, Python's prefixes, and `extra`."""
    paths = [*SYSTEM_PATHS, sys.prefix, sys.base_prefix, sys.exec_prefix, *extra]
    out: list[str] = []
    for p in paths:
        p = os.path.abspath(p)
        if os.path.lexists(p) and p not in out and not any(p.startswith(q + "/") for q in out if not
                                                           os.path.islink(q)):
            out.append(p)
    return out


async def _pipe(r, w):
    """Copy one direction of a connection until its end. The host side of `reach` runs it, and so does the
    forwarder inside the namespace (its source is part of the forwarder's)."""
    try:
        while data := await r.read(1 << 16):
            w.write(data)
            await w.drain()
    except OSError:
        pass
    finally:
        w.close()


# Runs inside the sandbox's network namespace (before any chroot, with this Python): brings loopback up and
# listens on each allowed address there, passing every connection through a Unix socket to the host side
# (`Sandbox._bridge`), which connects to the same address on the host. Dies with the sandbox's command.
_FORWARDER = r"""
import asyncio, ctypes, fcntl, json, signal, socket, struct, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: go when the command's shell goes
s = socket.socket()
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]  # SIOCGIFFLAGS
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))  # SIOCSIFFLAGS: IFF_UP
s.close()
spec, ready = json.loads(sys.argv[1]), sys.argv[2]
""" + inspect.getsource(_pipe) + r"""
async def main():
    for host, port, path in spec:
        async def handle(r, w, path=path):
            try:
                ur, uw = await asyncio.open_unix_connection(path)
            except OSError:
                w.close()
                return
            await asyncio.gather(_pipe(r, uw), _pipe(ur, w))
        await asyncio.start_server(handle, host, port)
    open(ready, "w").close()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _forwarder_lines(spec: list[tuple[str, int, str]], ready: str) -> list[str]:
    q = shlex.quote
    return [f"{q(sys.executable)} -c {q(_FORWARDER)} {q(json.dumps(spec))} {q(ready)} &",
            f"i=0; while [ ! -e {q(ready)} ]; do i=$((i+1)); [ $i -lt 1000 ] || exit 70; sleep 0.01; done"]


def _mount_script(new_root: Path, task: Path, ro: list[str], forward: list[str] | None = None) -> str:
    """The shell that builds the sandbox's root inside its mount namespace and runs the command there
    (`forward`: lines that start the network forwarder first)."""
    q = shlex.quote
    r = str(new_root)
    lines = ["set -e", *(forward or []), f"mount -t tmpfs -o mode=755,size=64m tmpfs {q(r)}"]
    for p in ro:
        target = q(r + p)
        if os.path.islink(p):  # e.g. /bin -> usr/bin on merged-/usr systems
            lines += [f"mkdir -p {q(r + os.path.dirname(p))}", f"ln -s {q(os.readlink(p))} {target}"]
            continue
        make = f"mkdir -p {target}" if os.path.isdir(p) else f"mkdir -p {q(r + os.path.dirname(p))}; : > {target}"
        lines += [make, f"mount --rbind {q(p)} {target}", f"mount -o remount,bind,ro {target}"]
    lines += [f"mkdir -p {q(r + TASK_DIR)} {q(r + '/dev')} {q(r + '/proc')}",
              f"mkdir -p {q(r + '/tmp')}", f"chmod 1777 {q(r + '/tmp')}",
              f"mount --bind {q(str(task))} {q(r + TASK_DIR)}",
              f"mount -t proc proc {q(r + '/proc')}"]
    for dev in ("null", "zero", "random", "urandom"):
        lines += [f": > {q(r + '/dev/' + dev)}", f"mount --bind /dev/{dev} {q(r + '/dev/' + dev)}"]
    lines.append(f"exec chroot {q(r)} /bin/sh -c 'cd {TASK_DIR} && exec \"$@\"' sh \"$@\"")
    return "\n".join(lines)


class Sandbox:
    def __init__(self, time_limit_s: float = 10.0, memory_mb: int = 1024, network: bool = False,
                 max_output_bytes: int = 1 << 20, max_file_mb: int = 64, max_processes: int = 64,
                 isolate_files: bool = True, toolchain: tuple[str, ...] = (),
                 reach: tuple[tuple[str, int], ...] = ()):
        """`isolate_files`: the command sees only the task folder (read-write, at ``/task``) and the toolchain
        (read-only: `toolchain_paths` with `toolchain` added, e.g. a folder of npm-installed CLIs).
        `reach`: loopback TCP addresses of this host (say, the agent adapter's) that the command may connect to,
        at the same address; nothing else is reachable (use with ``async with``)."""
        for host, port in reach:
            if host not in ("127.0.0.1", "localhost") or not 0 < int(port) < 65536:
                raise SandboxError(f"reach: {host}:{port} is not a loopback address of this host")
        self.reach = tuple((("127.0.0.1" if h == "localhost" else h), int(p)) for h, p in reach)
        self._bridges: list = []  # the host side of `reach`: Unix-socket servers
        self._net_dir: Path | None = None
        self.time_limit_s = time_limit_s
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.max_file_mb = max_file_mb
        self.max_processes = max_processes
        self.isolate_files = isolate_files
        self.toolchain = toolchain_paths(tuple(toolchain)) if isolate_files else []
        self.prefix: tuple[str, ...] = ()
        if not network or isolate_files:
            prefix = namespace_prefix(network=network, files=isolate_files)
            if prefix is None:
                want = " and ".join(w for w, on in (("a network namespace", not network),
                                                    ("mount and PID namespaces", isolate_files)) if on)
                raise SandboxError(f"cannot make {want} here (needs `unshare` as root or unprivileged user "
                                   f"namespaces); pass network=True and/or isolate_files=False to run without that "
                                   f"isolation")
            self.prefix = prefix
        self.root: Path | None = None
        self._new_root: Path | None = None

    @property
    def workdir(self) -> str:
        """The task folder as commands inside see it."""
        if self.root is None:
            raise SandboxError("the sandbox is not open (use it as a context manager)")
        return TASK_DIR if self.isolate_files else str(self.root)

    # -- lifetime --------------------------------------------------------------------------------

    def __enter__(self) -> Sandbox:
        self.root = Path(tempfile.mkdtemp(prefix="rlx-sandbox-"))
        if self.isolate_files:  # an empty folder the namespace mounts its root on (nothing is written to it)
            self._new_root = Path(tempfile.mkdtemp(prefix="rlx-sandbox-root-"))
        return self

    def __exit__(self, *exc) -> None:
        for server in self._bridges:
            server.close()
        self._bridges = []
        for d in (self.root, self._new_root, self._net_dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        self.root = self._new_root = self._net_dir = None

    async def _bridge(self) -> tuple[list[tuple[str, int, str]], Path]:
        """Start (once) a Unix-socket server per `reach` address that connects each client to that address on
        this host; the forwarder inside the sandbox's network namespace dials these sockets. Returns (host, port,
        socket) per address, and the folder of the sockets."""
        net = self._net_dir
        if net is None:
            net = self._net_dir = Path(tempfile.mkdtemp(prefix="rlx-sandbox-net-"))

            for i, (host, port) in enumerate(self.reach):
                async def handle(r, w, host=host, port=port):
                    try:
                        tr, tw = await asyncio.open_connection(host, port)
                    except OSError:
                        w.close()
                        return
                    await asyncio.gather(_pipe(r, tw), _pipe(tr, w))

                self._bridges.append(await asyncio.start_unix_server(handle, str(net / f"{i}.sock")))
        return [(h, p, str(net / f"{i}.sock")) for i, (h, p) in enumerate(self.reach)], net

    async def __aenter__(self) -> Sandbox:
        return self.__enter__()

    async def __aexit__(self, *exc) -> None:
        self.__exit__()

    # -- files -----------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        if self.root is None:
            raise SandboxError("the sandbox is not open (use it as a context manager)")
        p = (self.root / name).resolve()
        if not p.is_relative_to(self.root.resolve()):
            raise SandboxError(f"{name!r} is outside the sandbox")
        return p

    def write(self, name: str, content: str | bytes) -> Path:
        p = self.path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
        return p

    def read(self, name: str) -> str:
        p = self.path(name)
        if not p.exists():
            raise SandboxError(f"{name!r} does not exist in the sandbox")
        return p.read_text(errors="replace")

    # -- running ---------------------------------------------------------------------------------

    def _limits(self) -> None:  # in the child, before exec
        mem = self.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fsize = self.max_file_mb * 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.geteuid() != 0:  # root is not bound by RLIMIT_NPROC; do not pretend
            resource.setrlimit(resource.RLIMIT_NPROC, (self.max_processes, self.max_processes))

    async def run(self, cmd: list[str], stdin: str | None = None, timeout_s: float | None = None,
                  env: dict[str, str] | None = None) -> Result:
        """Run `cmd` in the sandbox directory; a failing program is a Result, not an exception."""
        if self.root is None:
            raise SandboxError("the sandbox is not open (use it as a context manager)")
        if not cmd:
            raise SandboxError("empty command")
        exe = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0])
        if exe is None:
            raise SandboxError(f"program {cmd[0]!r} not found")
        argv = [*self.prefix, exe, *cmd[1:]]
        forward = None
        if self.reach and "-n" in self.prefix:  # a network namespace: only `reach`, through the forwarder
            sockets, net = await self._bridge()
            forward = _forwarder_lines(sockets, str(net / f"ready-{time.monotonic_ns()}"))
        if self.isolate_files:
            if self._new_root is None:
                raise SandboxError("Sandbox.run() needs the sandbox entered: async with Sandbox(...) as box")
            exe = os.path.abspath(exe)
            if not any(exe == p or exe.startswith(p + "/") for p in self.toolchain):
                raise SandboxError(f"program {exe} is outside the sandbox's toolchain {self.toolchain}: add its "
                                   f"folder with Sandbox(toolchain=...)")
            script = _mount_script(self._new_root, self.root, self.toolchain, forward)
            argv = [*self.prefix, "sh", "-c", script, "sh", exe, *cmd[1:]]
        elif forward:
            argv = [*self.prefix, "sh", "-c", "\n".join(["set -e", *forward, 'exec "$@"']), "sh", exe, *cmd[1:]]
        limit = timeout_s or self.time_limit_s
        clean_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.workdir, "LANG": "C.UTF-8",
                     "PYTHONDONTWRITEBYTECODE": "1", **({"TMPDIR": "/tmp"} if self.isolate_files else {}),
                     **(env or {})}
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=self.root, env=clean_env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=self._limits)
        try:
            # stdin is always closed after `stdin` (if any): a program that reads it sees the end, not a wait
            out, err = await asyncio.wait_for(proc.communicate((stdin or "").encode()), limit)
            timed_out = False
        except asyncio.TimeoutError:
            _kill_group(proc.pid)
            out, err = await proc.communicate()
            timed_out = True
        except BaseException:  # cancelled (the caller's own time limit, a stopped rollout): nothing outlives it
            _kill_group(proc.pid)
            await asyncio.shield(proc.wait())
            raise
        cap = self.max_output_bytes
        return Result(None if timed_out else proc.returncode, out[:cap].decode(errors="replace"),
                      err[:cap].decode(errors="replace"), timed_out, time.monotonic() - t0)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- the test-based reward -------------------------------------------------------------------------

_FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


class SandboxTests:
    """1.0 when the sample's code passes the dataset label's tests in a sandbox, else 0.0."""

    name = "sandbox_tests"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        time_limit_s: float = Field(10.0, gt=0)
        memory_mb: int = Field(1024, ge=16)
        network: bool = False  # True only where no network namespace can be made (no isolation then)
        isolate_files: bool = True  # False only where no mount namespace can be made (the code sees every file)

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    async def score(self, sample: Sample) -> RewardResult:
        blocks = _FENCE.findall(sample.response_text)
        code = blocks[-1] if blocks else sample.response_text
        if not isinstance(sample.label, str) or not sample.label.strip():
            return RewardResult(0.0, info={"result": "no tests: the dataset label must be Python test code"})
        c = self.config
        async with Sandbox(time_limit_s=c.time_limit_s, memory_mb=c.memory_mb, network=c.network,
                           isolate_files=c.isolate_files) as box:
            box.write("solution.py", code)
            box.write("test_solution.py", sample.label)
            r = await box.run([sys.executable, "test_solution.py"])
            stderr = r.stderr.replace(box.workdir, ".")[-500:]
        why = "timed out" if r.timed_out else f"exit {r.returncode}"
        return RewardResult(1.0 if r.ok else 0.0, info={"result": why, "stderr": stderr})


@hookimpl
def register_rewards(register: RegisterRewards) -> None:
    register(SandboxTests)
