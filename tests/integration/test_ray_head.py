"""The run's own Ray head on a machine with a network address: Ray moves a 127.0.0.1 head onto that address, and
``ray start`` turns on token authentication by itself when ``~/.ray/auth_token`` exists (any earlier local
``ray.init()`` writes one) while ``ray.init(address=...)`` does not, so without rlx's own token the driver was
refused and retried forever. (``scripts/loopback`` sets ``RAY_AUTH_MODE=disabled`` for the rest of the suite;
this test clears it.) Runs in a network namespace this test makes, with a veth pair as the machine's network,
and a HOME holding such a token file."""

import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.integration

SCRIPT = """
import os, pathlib, sys
import ray
from rlx.orchestrate.ray_head import end_token_auth, start_head
head = start_head(1, pathlib.Path(sys.argv[1]), {})
try:
    print("RESULT", ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=60), ray.util.get_node_ip_address(),
          flush=True)
finally:
    ray.shutdown()
    head.stop()
    end_token_auth()
print("AFTER", sorted(k for k in os.environ if k.startswith("RAY_AUTH")), flush=True)
"""


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespace():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("not run: making a network namespace needs root and iproute2's `ip`")
    ns = f"rlxH{uuid.uuid4().hex[:6]}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "-n", ns, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1")
        sh("ip", "-n", ns, "addr", "add", "10.79.0.1/24", "dev", "veth0")
        for dev in ("lo", "veth0", "veth1"):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "route", "add", "default", "dev", "veth0")  # how Ray finds "the machine's address"
        yield ns
    finally:
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_the_driver_joins_its_head_when_a_ray_token_file_exists(namespace, tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(home), OMP_NUM_THREADS="1")
    try:
        r = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", SCRIPT, str(tmp_path / "logs")],
                           capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the driver did not join its Ray head in 120 s: {(e.stderr or b'')[-2000:]!r}")
    lines = [x for x in r.stdout.splitlines() if x.startswith(("RESULT", "AFTER"))]
    assert lines == ["RESULT 42 10.79.0.1", "AFTER []"], (r.stdout[-2000:], r.stderr[-3000:])  # env put back
