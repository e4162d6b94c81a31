"""The engines of a run, from config: launched (a topology of groups) or attached, plus the router.

Generation goes to one URL: the router when there is one, else the single engine. Control calls
(pause, abort, weight updates) go to each serving engine directly, because a router forwards a request
to one worker, not to all of them. With ``rollout.fault_tolerance`` (`rlx.rollout.engines.health`) an
engine that dies or freezes is taken out, restarted and let back in; only serving engines get control
calls and weights.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from rlx.config import Config, EngineGroupConfig, adapter_pushes, engines_offload, records_routing
from rlx.errors import RLXError
from rlx.models.tiny import resolve_model_path
from rlx.rollout.engines.client import EngineClient, EngineError
from rlx.rollout.engines.launch import (HOST, NO_AMX_ENV, ManagedProcess, embedded_command, free_port,
                                        sglang_command, sglang_cpu_args, wait_healthy)
from rlx.rollout.engines.router import Router


def sglang_on_cpu(cfg: Config, g: EngineGroupConfig) -> bool:
    """Whether a group's SGLang servers run on CPUs: its ``server_args.device``, else where they are placed
    (Ray: whether the engines' bundles hold GPUs; one host: whether this machine has one)."""
    if "device" in g.server_args:
        return g.server_args["device"] == "cpu"
    if cfg.ray.enabled:
        colocated = cfg.ray.placement == "colocated"
        return not (cfg.ray.gpus_per_trainer if colocated else cfg.ray.gpus_per_engine)
    import torch

    return not torch.cuda.is_available()


def speculative_args(g: EngineGroupConfig) -> dict[str, Any]:
    """SGLang's launch options for a group's speculative decoding (``speculative``), which the embedded engine takes
    too (n-gram and draft-model drafts). MTP drafts are SGLang's EAGLE over the checkpoint's own MTP layers, a draft
    model its STANDALONE; on SGLang each is a chain of num_draft_tokens single drafts (top-k 1, as slime runs them),
    which is what the embedded engine drafts."""
    spec = g.speculative
    if spec is None:
        return {}
    out: dict[str, Any] = {"speculative_algorithm": {"ngram": "NGRAM", "mtp": "EAGLE", "draft_model": "STANDALONE"}[
        spec.method], "speculative_num_draft_tokens": spec.num_draft_tokens + 1}
    if spec.draft_model:
        out["speculative_draft_model_path"] = resolve_model_path(spec.draft_model)
    if spec.method != "ngram" and g.backend == "sglang":
        out.update(speculative_num_steps=spec.num_draft_tokens, speculative_eagle_topk=1)
    return out


@dataclass
class Engine:
    url: str
    group: str
    worker_type: str = "regular"
    update_weights: bool = True
    tp_size: int = 1  # tensor-parallel ranks: each is one member of a weight-update group
    process: Any = None  # a ManagedProcess or alike; None: attached, not ours to stop
    timeout_s: float = 600  # a control or weight-update call (weight_sync.timeout_s)
    state: str = "serving"  # serving | down | restarting | joining | retired (see rlx.rollout.engines.health)
    restarts: int = 0
    launch: Any = None  # (group config, log path): how to start it again
    # one client per timeout, kept open across calls (their connections reused), for an owner that makes every
    # call from one event loop and closes them (`close_clients`); else a fresh client per call
    keep_clients: bool = False
    _clients: dict[float, EngineClient] = field(default_factory=dict, repr=False)

    def client(self, timeout_s: float | None = None) -> EngineClient:
        timeout_s = timeout_s or self.timeout_s
        if not self.keep_clients:
            return EngineClient(self.url, timeout_s=timeout_s)
        if timeout_s not in self._clients:
            self._clients[timeout_s] = EngineClient(self.url, timeout_s=timeout_s, keep_open=True)
        return self._clients[timeout_s]

    async def close_clients(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.close()

    def identity(self) -> str | None:
        """The engine process's `rlx.cpu.meter.process_identity`, when rlx started it (None: attached)."""
        return self.process.identity() if hasattr(self.process, "identity") else None


class EngineFleet:
    def __init__(self, cfg: Config, log_dir: Path, spawn=None,
                 engine_args: Callable[[str], dict[str, Any]] | None = None, engines_here: int | None = None):
        """`spawn(command, log_path, env) -> (process, url)` starts an engine process where it is placed: it
        calls ``command(host, port)`` with that host's address and a port free there, and starts it with `env`
        added to the environment (default: a local `ManagedProcess` on 127.0.0.1). `engine_args(model_path) ->
        dict`: SGLang server arguments that model's family needs (from its model spec); a group's own
        ``server_args`` override them. `engines_here`: the engines the run launches in all (its teachers' too), which
        share this machine's cores when nothing places them (default: this fleet's)."""
        self.spawn = spawn or _spawn_local
        self.cfg = cfg
        self.rc = cfg.rollout
        self.engine_args: Callable[[str], dict[str, Any]] = engine_args or (lambda path: {})
        self.engines_here = engines_here or sum(g.num_engines for g in self.rc.engines)
        self.log_dir = Path(log_dir)
        self.engines: list[Engine] = []
        self.router: Router | None = None
        self.url = ""
        self.front: EngineClient | None = None  # generation's client (the router, or the single engine)
        self.health: Any = None  # a FleetHealth with rollout.fault_tolerance

    @property
    def serving(self) -> list[Engine]:
        return [e for e in self.engines if e.state == "serving"]

    @property
    def weight_targets(self) -> list[Engine]:
        return [e for e in self.serving if e.update_weights]

    def _command(self, g: EngineGroupConfig, host: str, port: int, threads: int | None = None) -> list[str]:
        """The engine's command line; `threads`: its CPU threads where it was placed (`rlx.cpu`; default: as
        one of this run's engines on this machine)."""
        path = g.model_path or self.cfg.model.path
        quantized = self.rc.quantization is not None and g.update_weights  # (rollout.quantization) pushed as served
        if quantized and self.rc.quantization == "fp8":  # served from an FP8 checkpoint
            from rlx.models.fp8 import served

            path = str(served(resolve_model_path(path), self.cfg.run.output_dir))
        if g.backend == "embedded":
            if g.worker_type != "regular":
                raise RLXError(f"engine group {g.name!r}: the embedded engine has no {g.worker_type} mode; "
                               f"use backend: sglang for prefill/decode disaggregation")
            from rlx.cpu.threads import engine_threads

            args = dict(g.server_args)
            args["num_threads"] = engine_threads(threads or self._local_threads(), path, g.server_args)
            if g.tp_size != 1:
                raise RLXError(f"engine group {g.name!r}: the embedded engine runs one device (tp_size: 1)")
            if self.cfg.model.dtype != "auto":
                args.setdefault("dtype", self.cfg.model.dtype)
            # for requests without a sampling_seed of their own (all of them but under run.deterministic): engines
            # on one host have distinct ports, and so distinct draws for the samples of one prompt
            args.setdefault("random_seed", self.cfg.run.seed + port)
            if self.cfg.run.deterministic:
                args.setdefault("enable_deterministic_inference", True)
            if records_routing(self.cfg):
                args.setdefault("enable_return_routed_experts", True)
            if self.cfg.model.kernels:  # the trainer's kernel choices (a GDN model's gated delta rule, matmul)
                args.setdefault("kernels", json.dumps(self.cfg.model.kernels))
            if quantized:
                args.setdefault("quantization", self.rc.quantization)
            args = {**speculative_args(g), **self._lora_args(g), **args}
            return embedded_command(path, port, server_args=args, host=host)
        path = resolve_model_path(path)
        args = {**self.engine_args(path), **speculative_args(g), **self._lora_args(g), **g.server_args}
        if quantized:
            args.setdefault("quantization", self.rc.quantization)
        if records_routing(self.cfg):
            args.setdefault("enable_return_routed_experts", True)
        if engines_offload(self.cfg):  # without it SGLang's release_memory_occupation frees nothing
            args.setdefault("enable_memory_saver", True)
            if args.get("enable_lora"):  # the base weights come back from host memory: adapter pushes never resend
                args.setdefault("enable_weights_cpu_backup", True)  # them (SGLang's released weights are garbage)
        if args.get("enable_lora"):  # each adapter's versions in flight at once (async), and the base model
            versions = self.cfg.train.async_.max_staleness + 1 if self.cfg.train.mode == "async" else 1
            adapters = len(self.cfg.train.lora.names) if self.cfg.train.lora is not None else 1
            args.setdefault("max_loras_per_batch", max(8, adapters * versions + 1))
        dtype = self.cfg.model.dtype
        if self.cfg.run.deterministic:
            args.setdefault("enable_deterministic_inference", True)
        if sglang_on_cpu(self.cfg, g):
            if args.get("enable_deterministic_inference"):
                raise RLXError(f"engine group {g.name!r}: run.deterministic cannot run on SGLang on a CPU: SGLang's "
                               f"deterministic inference needs a GPU attention backend (fa3, flashinfer or triton); "
                               f"use backend: embedded for a reproducible run on a CPU")
            if args.get("enable_lora"):
                raise RLXError(f"engine group {g.name!r}: SGLang 0.5.23 cannot serve LoRA adapters on a CPU (its LoRA "
                               f"layers pin host memory through CUDA); use backend: embedded there, or "
                               f"train.lora.push: merged")
            if records_routing(self.cfg):
                raise RLXError(f"engine group {g.name!r}: routing replay (rollout.routed_experts) cannot run on SGLang "
                               f"on a CPU: SGLang 0.5.23 records routed experts into host memory it pins through "
                               f"CUDA (torch.cuda.cudart), which fails without a GPU; use backend: embedded for "
                               f"routing replay on a CPU")
            rc = self.rc
            requests = min(rc.requests.max_concurrency, round(rc.n_prompts * rc.n_samples_per_prompt *
                                                                 rc.partial_rollout.over_sampling))
            n = self.engines_here
            for k, v in sglang_cpu_args(path, requests=-(-requests // n), new_tokens=rc.sampling.max_new_tokens,
                                        engines=n).items():
                args.setdefault(k, v)
            dtype = "float32" if dtype == "auto" else dtype  # as the trainer on a CPU
        if dtype != "auto":  # the trainer's precision, so that their log-probs compare
            args.setdefault("dtype", dtype)
        return sglang_command(path, port, tp_size=g.tp_size, mem_fraction_static=g.mem_fraction_static,
                              worker_type=g.worker_type, server_args=args, host=host, python=g.python)

    def _lora_args(self, g: EngineGroupConfig) -> dict[str, Any]:
        """SGLang's LoRA options for engines that get the actor's adapters (``train.lora.push: adapter``): LoRA on, the
        largest rank and the modules adapters may target (SGLang sizes its adapter memory by them at launch)."""
        lora = self.cfg.train.lora
        if not (adapter_pushes(self.cfg) and g.update_weights):
            return {}
        assert lora is not None
        return {"enable_lora": True, "max_lora_rank": lora.rank, "lora_target_modules": list(lora.target_modules)}

    def _local_threads(self) -> int:
        from rlx.cpu.threads import local_plan

        return local_plan(self.cfg.train.mode, self.engines_here, cpus_per_engine=self.cfg.ray.cpus_per_engine,
                          async_cores=self.cfg.cpu.async_cores).engine[0]

    def _env(self, g: EngineGroupConfig) -> dict[str, str]:
        from rlx.cpu.threads import process_env

        env = process_env(self.cfg.train.mode, self.cfg.cpu.async_cores)
        if g.backend == "sglang" and sglang_on_cpu(self.cfg, g):
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            if g.server_args.get("dtype", self.cfg.model.dtype) in ("auto", "float32", "float", "fp32"):
                env[NO_AMX_ENV] = "1"  # SGLang's AMX kernels hold no fp32 (`rlx.rollout.engines.launch`)
        return env

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        timeout = self.cfg.weight_sync.timeout_s
        if self.rc.external_engines:
            self.engines = [Engine(u.rstrip("/"), "external", timeout_s=timeout) for u in self.rc.external_engines]
        elif self.rc.source != "replay":  # a replay trains on saved batches: no engine generates
            for g in self.rc.engines:
                for i in range(g.num_engines):
                    log_path = self.log_dir / f"engine-{g.name}-{i}.log"
                    proc, url = self.spawn(functools.partial(self._command, g), log_path, self._env(g))
                    self.engines.append(Engine(url, g.name, g.worker_type, g.update_weights, tp_size=g.tp_size,
                                               process=proc, timeout_s=timeout, launch=(g, log_path)))
        await asyncio.gather(*(wait_healthy(e.url, e.process, self.rc.startup_timeout_s) for e in self.engines))
        if not self.engines:
            return
        if self.rc.external_engines:  # what an attached engine runs, it says itself
            for e, tp in zip(self.engines, await self.for_each(lambda c: c.tp_size()), strict=True):
                e.tp_size = tp

        prefill = [e.url for e in self.engines if e.worker_type == "prefill"]
        decode = [e.url for e in self.engines if e.worker_type == "decode"]
        if bool(prefill) != bool(decode):
            raise RLXError("prefill/decode disaggregation needs at least one prefill and one decode group")
        use_router = self.rc.router.enabled
        if use_router is None:
            use_router = len(self.engines) > 1
        if prefill and not use_router:
            raise RLXError("prefill/decode disaggregation needs the router (rollout.router.enabled)")
        if use_router:
            self.router = Router(self.rc.router.policy, self.rc.router.port, self.log_dir, self.rc.router.args,
                                 prefill_urls=prefill, decode_urls=decode)
            await self.router.start()
            for e in self.engines:
                if e.worker_type == "regular":
                    await self.router.add_worker(e.url)
            self.url = self.router.url
        else:
            self.url = self.engines[0].url
        self.front = EngineClient(self.url, timeout_s=self.rc.requests.timeout_s)
        if self.rc.fault_tolerance.enabled:
            from rlx.rollout.engines.health import FleetHealth

            self.health = FleetHealth(self, self.rc.fault_tolerance, self.rc.startup_timeout_s)
            self.health.start()

    def client(self) -> EngineClient:
        """Generation's client: the router, or the single engine (its address follows a restart)."""
        assert self.front is not None, "start() first"
        return self.front

    async def for_each(self, fn, engines: list[Engine] | None = None) -> list:
        """Call ``fn(client)`` on every serving engine (or on `engines`) concurrently (control calls bypass
        the router). With
        fault tolerance, an engine whose call fails and that then fails a health probe is taken out and
        skipped (its result is None); any other failure is raised."""

        async def one(e: Engine):
            try:
                async with e.client() as c:
                    return await fn(c)
            except EngineError:
                if self.health is not None and not await self.health.probe(e, strict=True):
                    return None
                raise

        return await asyncio.gather(*(one(e) for e in (self.serving if engines is None else engines)))

    async def context_length(self) -> int | None:
        """The least context length the serving engines report (None: none reports one)."""
        lengths = [n for n in await self.for_each(lambda c: c.context_length()) if n]
        return min(lengths) if lengths else None

    def respawn(self, e: Engine) -> None:
        """Start a launched engine again where it was (its old process is gone): a new process and URL."""
        g, log_path = e.launch
        e.process, e.url = self.spawn(functools.partial(self._command, g), log_path, self._env(g))

    async def stop(self) -> None:
        if self.health is not None:
            await self.health.stop()
            self.health = None
        if self.front is not None:
            await self.front.close()
        if self.router is not None:
            await self.router.stop()
            self.router = None
        for e in self.engines:
            if e.process is not None:
                e.process.stop()
        self.engines = []


def _spawn_local(command: Callable[[str, int], list[str]], log_path: Path,
                 env: dict[str, str] | None = None) -> tuple[ManagedProcess, str]:
    port = free_port()
    proc = ManagedProcess(command(HOST, port), log_path)
    proc.start(env)
    return proc, f"http://{HOST}:{port}"
