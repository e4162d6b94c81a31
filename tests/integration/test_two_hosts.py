"""Two hosts on one machine: two network namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2), each
a Ray node started as docs/guides/many-hosts.md starts one (`ray start --head`, `ray start --address`, one
authentication token for the cluster). A run joins that cluster with the trainer on one host and the engine on the
other, trains, and syncs weights across them by broadcast. Every address comes from Ray; nothing is reached but the two
namespaces this test makes."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration

A_IP, B_IP = "10.77.0.1", "10.77.0.2"
BIN = Path(sys.executable).parent


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class TwoHosts:
    def __init__(self, suffix: str):
        self.a, self.b = f"rlxA{suffix}", f"rlxB{suffix}"
        self.temp = Path(f"/tmp/rlx2h-{suffix}")  # Ray's socket paths must stay short
        self.procs: list[subprocess.Popen] = []
        self.token = secrets.token_hex(32)

    def up(self) -> None:
        sh("ip", "netns", "add", self.a)
        sh("ip", "netns", "add", self.b)
        va, vb = f"v{self.a[-7:]}", f"v{self.b[-7:]}"
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, ip in ((self.a, va, A_IP), (self.b, vb, B_IP)):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "link", "set", dev, "name", "veth0")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "veth0")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", "veth0", "up")

    def start(self, ns: str, cmd: list[str], log: Path) -> subprocess.Popen:
        # as docs/guides/many-hosts.md launches a cluster: one token for every node and the driver
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}
        p = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        self.procs.append(p)
        return p

    def wait_port(self, ns: str, ip: str, port: int, timeout_s: float = 60) -> None:
        probe = f"import socket; socket.create_connection(({ip!r}, {port}), timeout=1).close()"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe],
                              capture_output=True, timeout=30).returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError(f"{ip}:{port} did not open in namespace {ns}")

    def down(self) -> None:
        for p in reversed(self.procs):  # `ray start --block` stops its node on SIGTERM
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ns in (self.a, self.b):  # anything left inside (Ray workers start sessions of their own)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.temp, ignore_errors=True)


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    return None


@pytest.fixture
def hosts():
    why = why_not()
    if why:
        pytest.skip(f"two-host test not run: {why}")
    h = TwoHosts(uuid.uuid4().hex[:6])
    try:
        h.up()
        yield h
    finally:
        h.down()


def test_trainer_and_engine_on_two_hosts_train_and_sync_weights(hosts, tiny_model_path, tmp_path):
    port = 6379
    ray = str(BIN / "ray")
    common = ["--disable-usage-stats", "--num-cpus=1", "--block"]
    hosts.start(hosts.a, [ray, "start", "--head", f"--node-ip-address={A_IP}", f"--port={port}",
                          "--include-dashboard=false", f"--temp-dir={hosts.temp}", *common], tmp_path / "head.log")
    hosts.wait_port(hosts.a, A_IP, port)
    hosts.start(hosts.b, [ray, "start", f"--address={A_IP}:{port}", f"--node-ip-address={B_IP}", *common],
                tmp_path / "worker.log")

    cfg = small_run_config(tmp_path, "run", weight_sync={"transport": "broadcast"},
                           ray={"address": f"{A_IP}:{port}", "placement": "disaggregated", "cpus_per_trainer": 1,
                                "cpus_per_engine": 1})
    # each node has one CPU, so the trainer's bundle and the engine's cannot share a node
    driver = hosts.start(hosts.a, [sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], tmp_path / "driver.log")
    try:
        code = driver.wait(420)
    except subprocess.TimeoutExpired:
        code = None
    log = (tmp_path / "driver.log").read_text(errors="replace")
    assert code == 0, log[-4000:]
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    trainer_host = placement["trainers"][0]
    engine_host = placement["engines"][0].removeprefix("http://").rsplit(":", 1)[0]
    assert {trainer_host, engine_host} == {A_IP, B_IP}, placement
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["weight_version"] for s in steps] == [1, 2, 3]  # each push verified on the engine, across hosts


def test_gloo_binds_the_address_it_is_given():
    from rlx.net import gloo_options, interface_for

    assert interface_for("127.0.0.1") == "lo"
    assert interface_for("203.0.113.9") is None  # an address no interface here holds
    assert len(gloo_options("127.0.0.1")._devices) == 1
