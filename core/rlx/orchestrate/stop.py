"""Stopping a run by signal: the first Ctrl-C or SIGTERM at the end of the step, the second at once."""

from __future__ import annotations

import asyncio
import signal
import sys


class StopRequest:
    """Ctrl-C or SIGTERM during `train`: the first stops the run at the end of the step that runs, with a
    checkpoint of what trained since the last one; a second Ctrl-C stops at once (the main task is
    cancelled: engines and trainers are still stopped). Without a main-thread event loop (a run in a
    thread), signals keep their default behaviour."""

    def __init__(self) -> None:
        import signal

        self.signum: int | None = None
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.installed: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.loop.add_signal_handler(sig, self._on, sig)
                self.installed.append(sig)
            except (RuntimeError, ValueError):  # not the main thread
                pass

    @property
    def name(self) -> str:
        names: dict[int | None, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
        return names.get(self.signum, f"signal {self.signum}")

    def _on(self, sig: int) -> None:
        if self.signum is None:
            self.signum = sig
            print(f"\nrlx: {self.name}: stopping at the end of this step, with a checkpoint "
                  f"(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        elif self.task is not None:
            self.task.cancel()

    def close(self) -> None:
        for sig in self.installed:
            self.loop.remove_signal_handler(sig)
        self.installed = []
