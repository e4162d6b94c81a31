"""Addresses on one host or many: which address this process is reachable at, and gloo bound to it.

On one host everything uses 127.0.0.1. Across hosts each process's address is its Ray node's IP, and
gloo must be told which interface to use: by default it resolves the machine's hostname, which often
maps to loopback, and then connects nowhere.
"""

from __future__ import annotations

import os
import random
import socket
import struct
from typing import Any

LOOPBACK = "127.0.0.1"


# Ports rlx hands out lie outside the kernel's ephemeral range (from which every outgoing connection takes its
# source port and every bind to port 0 its port) and outside Ray's worker ports (10002-19999 by default). A port
# from bind(0) is only free until the next outgoing connection, and an engine binds the port it was given only
# after loading its model, seconds later: with Ray's many connections alive, that port was sometimes taken.
_LOWEST = 20000
_given: set[int] = set()  # ports this process handed out: not again
_rng = random.SystemRandom()  # not the seeded module generator: two runs with one seed must not pick alike


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    """A port that is free on `host` now, for a server that binds it soon after: not one the kernel hands out
    on its own (see above), and not one this process handed out before. Where the ephemeral range leaves no
    such ports, one the kernel picks."""
    lo, hi = _ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST, lo - 1), (max(hi + 1, _LOWEST), 65535)) if a <= b]
    total = sum(b - a + 1 for a, b in spans)
    for _ in range(200 if total else 0):
        port = _rng.randrange(total)  # an index into the spans, made a port below
        for a, b in spans:
            if port <= b - a:
                port += a
                break
            port -= b - a + 1
        if port not in _given and _bindable(host, port):
            _given.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This process's address as Ray knows it (loopback outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return LOOPBACK


def interface_for(ip: str) -> str | None:
    """The name of the network interface holding `ip` (Linux), or None."""
    import fcntl

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:
                continue
            if addr == ip:
                return name
    return None


def use_interface_of(ip: str) -> None:
    """Make gloo groups this process creates through ``init_process_group``/``new_group`` use the interface
    holding `ip` (unless ``GLOO_SOCKET_IFNAME`` is already set, or `ip` is loopback)."""
    if ip.startswith("127.") or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_for(ip)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def gloo_options(ip: str | None) -> Any:
    """Options for a ``ProcessGroupGloo`` made directly, bound to `ip` (None or a wildcard: gloo's default)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's private options, not in its types
    if ip and ip not in ("0.0.0.0", "::"):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return opts
