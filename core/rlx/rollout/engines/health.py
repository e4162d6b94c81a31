"""Engine fault tolerance: a dead or frozen engine costs the run a few seconds, never the run.

`FleetHealth` watches the engines of an `EngineFleet` (``rollout.fault_tolerance``):

* **Probes.** Every ``probe_interval_s`` each serving engine's process is checked (launched engines) and its
  HTTP server asked for any answer within ``probe_timeout_s`` (``/model_info``: not SGLang's ``/health``,
  which generates a token and so fails while an engine is paused, offloaded or taking weights). A process
  that exited is out at once; ``failures`` failed probes in a row (a frozen engine: SIGSTOP, a server that
  stopped answering) take it out too. A scheduler that hangs while its HTTP server answers is not detected
  by probes; its requests fail at ``rollout.requests.timeout_s`` and are sent again. A control call (pause, abort)
  that fails on an engine that then fails a probe takes it out at once.
* **Out.** An engine taken out leaves the router (no new requests) and weight sync (the next push goes to
  the others). A launched one is killed (SIGKILL of its process group): a frozen process holds its
  requests, and cutting its connections makes them fail now instead of after ``rollout.requests.timeout_s``.
* **Requests sent again.** A generate request that failed because its engine failed (unreachable, 5xx) is
  sent again once an engine serves (`GenerateContext.generate`), at most ``max_resends`` times; a request
  in flight when an *attached* engine is taken out (which rlx cannot kill) is cancelled and sent again.
  Nothing of a failed request was kept (requests are not streamed), so a sample resumes from exactly the
  tokens it had: a multi-turn or partial-rollout sample from its prefix, never a token twice.
* **Back in.** A launched engine is restarted in its place (same bundle, same log, appended), up to
  ``max_restarts`` times; an attached one is probed until it answers. Before it serves it is brought to
  the trainer's current weights (it waits in ``joins``, which the training loop serves: a push to that engine
  alone), then it rejoins the router and weight sync, both while the trainer's weights cannot change. Prefill/decode
  engines are taken out but not restarted (the router's prefill and decode lists are fixed at its start).
* **Metrics:** ``engines/serving``, ``engines/taken_out``, ``engines/restarts``, ``engines/rejoined`` and
  ``rollout/resent_requests`` (totals since the start), logged with every step.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import TYPE_CHECKING

from rlx.config import FaultToleranceConfig
from rlx.rollout.engines.client import EngineClient, EngineError
from rlx.rollout.engines.launch import wait_healthy

if TYPE_CHECKING:
    from rlx.rollout.engines.fleet import Engine, EngineFleet

log = logging.getLogger(__name__)


def say(msg: str) -> None:
    print(f"rlx: {msg}", file=sys.stderr, flush=True)


def resendable(error: EngineError) -> bool:
    """Whether a failed request may succeed on another engine: its engine was unreachable, timed out or
    failed (5xx); a 4xx is the request's own fault and fails again anywhere."""
    return error.status is None or error.status >= 500


class FleetHealth:
    def __init__(self, fleet: EngineFleet, cfg: FaultToleranceConfig, startup_timeout_s: float):
        self.fleet = fleet
        self.cfg = cfg
        self.startup_timeout_s = startup_timeout_s
        #: Engines back that must first get the trainer's current weights, each with a future to set once it was
        #: admitted (`admit`) or could not be: a training run serves them (`rlx.orchestrate.weights.Weights.joins`).
        #: None (rollout alone, `rl serve`): engines keep the weights they start with and are admitted at once.
        self.joins: asyncio.Queue[tuple[Engine, asyncio.Future]] | None = None
        self.counts = {"engines/taken_out": 0, "engines/restarts": 0, "engines/rejoined": 0,
                       "rollout/resent_requests": 0}
        self.fails: dict[str, int] = {}  # consecutive failed probes per URL
        self.recovering: dict[int, asyncio.Task] = {}  # per engine (id)
        self.down_times: list[float] = []  # when each engine was taken out (monotonic), for time-to-healthy
        self.recovered_s: list[float] = []  # from taken out to serving again, per recovery
        self._serving = asyncio.Event()
        self._serving.set()
        self._down: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task | None = None
        self._settling: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        # a fleet started under one event loop and stopped under another (asyncio.run twice): the first
        # loop's tasks ended with it
        loop = asyncio.get_running_loop()
        tasks = [t for t in [self._task, self._settling, *self.recovering.values()]
                 if t is not None and t.get_loop() is loop]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self.recovering.clear()

    def metrics(self) -> dict[str, float]:
        return {"engines/serving": float(len(self.fleet.serving)), **{k: float(v) for k, v in self.counts.items()}}

    # -- probing ---------------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)
            results = await asyncio.gather(*(self.probe(e) for e in self.fleet.serving), return_exceptions=True)
            for r in results:  # a probe that broke must not end the watch
                if isinstance(r, Exception):
                    log.warning("engine probe failed: %s: %s", type(r).__name__, r)

    async def probe(self, e: Engine, *, strict: bool = False) -> bool:
        """Whether `e` serves; takes it out when its process exited, after ``failures`` failed probes in a
        row, or (`strict`, after a failed call) at the first failed probe."""
        if e.state != "serving":
            return False
        if e.process is not None and not await asyncio.to_thread(e.process.alive):
            await self.take_out(e, f"its process exited with code {e.process.returncode}")
            return False
        async with EngineClient(e.url, timeout_s=self.cfg.probe_timeout_s) as c:
            ok = await c.alive(self.cfg.probe_timeout_s)
        if ok:
            self.fails[e.url] = 0
            return True
        n = self.fails[e.url] = self.fails.get(e.url, 0) + 1
        if strict or n >= self.cfg.failures:
            await self.take_out(e, f"{n} health probe(s) in a row failed (none answered within "
                                   f"{self.cfg.probe_timeout_s:g}s: dead, frozen or overloaded)")
        return False

    # -- out and back in ---------------------------------------------------------------------------

    async def take_out(self, e: Engine, reason: str) -> None:
        if e.state != "serving":
            return
        e.state = "down"
        self.counts["engines/taken_out"] += 1
        self.down_times.append(time.monotonic())
        serving = self.fleet.serving
        say(f"engine {e.url} (group {e.group}) taken out: {reason}; {len(serving)} of "
            f"{len(self.fleet.engines)} engines serve")
        if not serving:
            self._serving.clear()
        self.recovering[id(e)] = asyncio.create_task(self._recover(e, self.down_times[-1]))

    async def _recover(self, e: Engine, since: float) -> None:
        try:
            if self.fleet.router is not None and e.worker_type == "regular":
                try:
                    await self.fleet.router.remove_worker(e.url)
                except EngineError as err:  # the router may have dropped it on its own already
                    log.info("removing %s from the router: %s", e.url, err)
            if e.process is not None:  # cut a frozen engine's connections: its requests fail now
                try:
                    await asyncio.to_thread(e.process.stop, 0.0)
                except Exception as err:  # noqa: BLE001 - e.g. its Ray host actor died with it
                    log.info("stopping %s: %s", e.url, err)
            down, self._down = self._down, asyncio.get_running_loop().create_future()
            down.set_result(e.process is None)  # attached: its requests may hang until they time out
            if e.worker_type != "regular":
                e.state = "retired"
                say(f"{e.worker_type} engine {e.url} stays out: prefill/decode engines are not restarted (the "
                    f"router's prefill and decode lists are fixed at its start)")
                return
            if e.process is not None:
                if not self.cfg.restart or e.restarts >= self.cfg.max_restarts:
                    e.state = "retired"
                    say(f"engine {e.url} stays out: restarted {e.restarts} time(s) of "
                        f"rollout.fault_tolerance.max_restarts {self.cfg.max_restarts}")
                    return
                e.state = "restarting"
                e.restarts += 1
                self.counts["engines/restarts"] += 1
                old = e.url
                await asyncio.to_thread(self.fleet.respawn, e)
                await wait_healthy(e.url, e.process, self.startup_timeout_s)
                say(f"engine {old} restarted as {e.url} (restart {e.restarts}); bringing it to the current weights")
            else:
                async with EngineClient(e.url, timeout_s=self.cfg.probe_timeout_s) as c:
                    while not await c.health(timeout_s=self.cfg.probe_timeout_s):  # serving, not just up
                        await asyncio.sleep(self.cfg.probe_interval_s)
                say(f"engine {e.url} answers again; bringing it to the current weights")
            await self.rejoin(e)
            self.recovered_s.append(time.monotonic() - since)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - said, and the run goes on with the others
            e.state = "retired"
            say(f"engine {e.url} could not be brought back and stays out: {err}")
        finally:
            self.recovering.pop(id(e), None)
            if not self.fleet.serving and not self.recovering:
                self._serving.set()  # wake the waiters: `wait_serving` fails them with the reason

    async def rejoin(self, e: Engine) -> None:
        e.state = "joining"
        if self.joins is not None and e.update_weights:
            done = asyncio.get_running_loop().create_future()
            await self.joins.put((e, done))
            await done  # brought to the trainer's weights and admitted before they can change again, or why not
        else:
            await self.admit(e)
        self.fails[e.url] = 0
        self.counts["engines/rejoined"] += 1
        self._serving.set()
        say(f"engine {e.url} serves again; {len(self.fleet.serving)} of {len(self.fleet.engines)} engines serve")

    async def admit(self, e: Engine) -> None:
        """Let `e` serve: into the router, or as the single engine at its new address."""
        if self.fleet.router is not None:
            await self.fleet.router.add_worker(e.url)
        else:
            assert self.fleet.front is not None, "start() first"
            self.fleet.url = self.fleet.front.base_url = e.url
        e.state = "serving"

    # -- what requests wait for ------------------------------------------------------------------

    async def settle(self) -> None:
        """After a request failed: probe every serving engine now (one that fails is taken out at once), so
        that the request is not sent again to the engine that failed it. Concurrent callers share one round."""
        if self._settling is None or self._settling.done():
            async def round_() -> None:
                await asyncio.gather(*(self.probe(e, strict=True) for e in self.fleet.serving))
                await asyncio.sleep(min(self.cfg.probe_interval_s, 0.5))

            self._settling = asyncio.create_task(round_())
        await asyncio.shield(self._settling)

    async def wait_serving(self) -> None:
        """Return once an engine serves; an `EngineError` when none will (all retired) or none did within
        ``recovery_timeout_s``."""
        deadline = time.monotonic() + self.cfg.recovery_timeout_s
        while not self.fleet.serving:
            if not self.recovering:
                raise EngineError(f"no engine serves: all {len(self.fleet.engines)} were taken out and none came "
                                  f"back (see the lines above and the engine logs under {self.fleet.log_dir})")
            self._serving.clear()
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    await self._serving.wait()
            except TimeoutError:
                raise EngineError(f"no engine served for rollout.fault_tolerance.recovery_timeout_s "
                                  f"({self.cfg.recovery_timeout_s:g}s); engine logs under {self.fleet.log_dir}") from None

    def next_down(self) -> asyncio.Future:
        """A future that completes when the next engine is taken out, with whether requests on it may
        hang (an attached engine, which rlx cannot kill)."""
        return self._down
