"""Addresses on one host or many: which address this process is reachable at, and gloo bound to it.

On one host everything uses 127.0.0.1. Across hosts each process's address is its Ray node's IP, and
gloo must be told which interface to use: by default it resolves the machine's hostname, which often
maps to loopback, and then connects nowhere.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port that is free on `host` now (the caller binds it soon after)."""
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

    opts = dist.ProcessGroupGloo._Options()
    if ip and ip not in ("0.0.0.0", "::"):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return opts
