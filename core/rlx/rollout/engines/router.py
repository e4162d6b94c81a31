"""sglang-router, the Rust router from PyPI, in front of the engines on 127.0.0.1.

Workers are added with ``POST /workers {"url": ...}`` and removed with ``DELETE /workers/{id}``. The
router accepts an addition at once and probes the worker in the background, so `add_worker` waits
until the worker is listed (or the router gave up on it) before it returns. Policies: cache_aware
(default), round_robin, power_of_two, random. Prefill/decode groups start it in PD mode.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from rlx.rollout.engines.client import EngineClient, EngineError
from rlx.rollout.engines.launch import HOST, ManagedProcess, flags, free_port, wait_healthy


def router_command(port: int, policy: str, *, worker_urls: list[str] = (),  # type: ignore[assignment]
                   prefill_urls: list[str] = (), decode_urls: list[str] = (),  # type: ignore[assignment]
                   extra: dict[str, Any] | None = None) -> list[str]:
    # Its Prometheus exporter would take a fixed port on every address; give it a free loopback one.
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port),
           "--prometheus-host", HOST, "--prometheus-port", str(free_port())]
    if prefill_urls or decode_urls:
        cmd += ["--pd-disaggregation", "--policy", policy]
        for u in prefill_urls:
            cmd += ["--prefill", u]
        for u in decode_urls:
            cmd += ["--decode", u]
    else:
        cmd += ["--policy", policy]
        if worker_urls:
            cmd += ["--worker-urls", *worker_urls]
    return cmd + flags(extra or {})


class Router:
    """A running sglang-router process and its worker-management API."""

    def __init__(self, policy: str = "cache_aware", port: int | None = None, log_dir: Path = Path("."),
                 extra: dict[str, Any] | None = None, prefill_urls: list[str] = (),  # type: ignore[assignment]
                 decode_urls: list[str] = ()):  # type: ignore[assignment]
        self.port = port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.process = ManagedProcess(
            router_command(self.port, policy, prefill_urls=list(prefill_urls), decode_urls=list(decode_urls),
                           extra=extra),
            Path(log_dir) / "router.log",
        )
        self.client = EngineClient(self.url, timeout_s=60)

    async def start(self, timeout_s: float = 60) -> None:
        self.process.start(env={"NO_COLOR": "1", "RUST_LOG_STYLE": "never"})
        await wait_healthy(self.url, self.process, timeout_s, what="sglang-router")

    async def workers(self) -> list[dict[str, Any]]:
        return (await self.client.request("GET", "/workers")).get("workers", [])

    async def add_worker(self, url: str, timeout_s: float = 60) -> None:
        await self.client.request("POST", "/workers", {"url": url})
        deadline = time.monotonic() + timeout_s
        while not any(w.get("url") == url for w in await self.workers()):
            if time.monotonic() > deadline:
                raise EngineError(f"sglang-router did not accept worker {url} within {timeout_s:.0f}s; "
                                  f"log {self.process.log_path}:\n{self.process.log_tail(5)}")
            await asyncio.sleep(0.1)

    async def remove_worker(self, url: str, timeout_s: float = 30) -> None:
        ids = [w.get("id") or w.get("worker_id") for w in await self.workers() if w.get("url") == url]
        if not ids:
            raise EngineError(f"sglang-router has no worker {url}")
        for wid in ids:
            await self.client.request("DELETE", f"/workers/{wid}")
        deadline = time.monotonic() + timeout_s
        while any(w.get("url") == url for w in await self.workers()):
            if time.monotonic() > deadline:
                raise EngineError(f"sglang-router still lists {url} {timeout_s:.0f}s after removing it")
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        await self.client.close()
        self.process.stop()
