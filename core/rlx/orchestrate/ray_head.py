"""The run's own Ray head (when ``ray.address`` is not set), its token authentication, and keeping Ray's
start-up chatter out of the terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from rlx.errors import RLXError


@contextlib.contextmanager
def stderr_to(log_path: Path | None):
    """Send this process's standard error (the file descriptor: Ray's driver writes from C++ as well as
    Python while it connects) to `log_path` for the block; None leaves it alone."""
    if log_path is None:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def start_head(num_cpus: int | None, log_dir: Path, init: dict[str, Any]):
    """A Ray head for this run: ``ray start --head --block`` as a child that dies with this process.

    Not ``ray.init()``'s built-in local cluster: if the driver is killed with SIGKILL, that cluster's
    per-node agents outlive it. ``ray start --block`` stops everything it started when it gets SIGTERM,
    which it does when this process dies (PR_SET_PDEATHSIG) or stops it. Returns the head process,
    with this process connected to it (``ray.init(**init)``).
    """
    import shutil
    import sys
    import time

    import ray

    from rlx.rollout.engines.launch import HOST, ManagedProcess, free_port

    port = free_port()
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    cmd = [ray_bin, "start", "--head", "--block", f"--port={port}", f"--node-ip-address={HOST}",
           "--include-dashboard=false", "--disable-usage-stats", f"--dashboard-agent-listen-port={free_port()}"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    head = ManagedProcess(cmd, log_dir / "ray-head.log")
    run_token_auth()
    try:
        # Ray drains a node for 30 s on SIGTERM (for Serve replicas to move); this cluster is the run's own and
        # its work is over when it is stopped: no drain, so a run ends (or fails) without a 30 s wait.
        head.start(env={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
        address = f"{HOST}:{port}"
        deadline = time.monotonic() + 120
        while True:
            if not head.alive():
                raise RLXError(f"ray start exited with code {head.returncode}; log {head.log_path}:\n"
                               f"{head.log_tail()}")
            try:
                ray.init(address=address, **init)
                return head
            except (ConnectionError, RuntimeError):
                if time.monotonic() > deadline:
                    raise RLXError(f"the Ray head at {address} did not come up in 120s; log {head.log_path}") from None
                time.sleep(0.5)
    except BaseException:
        head.stop()
        end_token_auth()
        raise


_saved_auth: dict[str, str | None] | None = None  # the environment `run_token_auth` replaced, until `end_token_auth`


def run_token_auth() -> None:
    """Token authentication for the run's own Ray cluster, with a token of its own, unless ``RAY_AUTH_MODE`` is set.

    Ray (2.5x-2.6x) turns 127.0.0.1 into the machine's network address when it has one, so the head listens
    there. ``ray start`` then enables token authentication by itself when a token file exists
    (``~/.ray/auth_token``, written by any earlier ``ray.init()`` that started a local cluster), while
    ``ray.init(address=...)`` does not: the driver is refused ("Authentication token is missing or incorrect")
    and retries forever. Setting the mode and a fresh token in this process's environment, which the head, its
    workers and this driver share, makes both ends agree and keeps the cluster closed to others on the network.
    `end_token_auth` puts the environment back when the cluster is gone.
    """
    import secrets

    global _saved_auth
    if "RAY_AUTH_MODE" in os.environ:  # the user's choice (with their token), for both ends
        return
    _saved_auth = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _refresh_ray_auth()


def end_token_auth() -> None:
    """Undo `run_token_auth` (nothing if it set nothing): a later cluster in this process gets its own settings."""
    global _saved_auth
    if _saved_auth is None:
        return
    for key, value in _saved_auth.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _saved_auth = None
    _refresh_ray_auth()


def _refresh_ray_auth() -> None:
    try:  # Ray caches its config and token; refresh both (what ray.init does when it enables auth)
        from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader
        from ray._raylet import Config  # type: ignore[attr-defined]  # Ray's private config, not in its stubs

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # another Ray layout: it reads the environment when it connects
        pass
