"""Small pieces the HTTP services rlx serves in-process (the agent adapter, the rollout buffer) share."""

from __future__ import annotations

from aiohttp import web


async def serve_local(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, str]:
    """Serve `app` in the running event loop; returns the runner (``await runner.cleanup()`` to stop) and
    the base URL with the real port (port 0 picks a free one)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, f"http://{host}:{runner.addresses[0][1]}"


def bearer_key(request: web.Request) -> str:
    """The key of ``Authorization: Bearer KEY`` ("" when there is none)."""
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else ""
