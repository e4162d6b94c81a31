"""An asyncio server (rlx's adapter, the rollout buffer) run in a background thread, for tests and
benchmarks that drive it with blocking clients such as the official SDKs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


class BackgroundLoop:
    """``with BackgroundLoop(server.start, server.stop):`` runs ``start()`` then the loop until exit."""

    def __init__(self, start: Callable[[], Awaitable[Any]], stop: Callable[[], Coroutine[Any, Any, Any]] | None = None):
        self.start, self.stop = start, stop
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.start())
        except BaseException as e:  # reported in __enter__
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def __enter__(self) -> BackgroundLoop:
        self.thread.start()
        if not self._ready.wait(60):
            raise TimeoutError("the background server did not start within 60 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.stop is not None and self._error is None:
            asyncio.run_coroutine_threadsafe(self.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
