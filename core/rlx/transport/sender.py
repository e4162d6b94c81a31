"""The trainer side of weight sync and HF export, on every trainer rank.

Only the ranks that own a stage's weights send them: per pipeline stage, data-parallel rank 0's
tensor-parallel group gathers each tensor in turn (`Trainer.hf_tensors`), and its tensor-parallel rank
0 hands the stream to the transport. No rank gathers the whole model. See `rlx.transport` for the
push protocol. Every step of a push ends with the ranks agreeing whether it worked, so an engine error
on one rank fails the push everywhere instead of leaving the others in a collective.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rlx.errors import RLXError
from rlx.transport import Adapter, TransportContext
from rlx.transport.verify import Fingerprints, served_dtypes, verify, verify_adapter

if TYPE_CHECKING:
    from rlx.plugins import ComponentRef, Plugins
    from rlx.protocols import Transport


T = TypeVar("T")


class Ranks(Protocol):
    """Where this rank stands among the trainer's (`rlx.train.model.ParallelState` has it)."""

    rank: int
    world: int


async def _tp_sizes(engines: list[Any]) -> list[int]:
    async def one(e):
        async with e.client(timeout_s=60) as c:
            return await c.tp_size()

    return list(await asyncio.gather(*(one(e) for e in engines)))


class WeightSender:
    def __init__(self, trainer: Any, plugins: Plugins, transport_spec: ComponentRef, verify_weights: str = "sample",
                 full_interval: int = 10, *, engine_for: Callable[[str], Any], quantization: str | None = None,
                 adapters: bool = False):
        """`trainer`: this rank's `Trainer` or `CriticTrainer` (Any: those are a layer above; it has ``par``).
        `engine_for(url)`: a handle on the engine at `url` that the transport calls (``url``,
        ``client(timeout_s=...)``, ``tp_size``, ``close_clients()``: `rlx.rollout.engines.fleet.Engine`).
        `quantization` (``rollout.quantization``): pushes quantised as the engines serve them: ``fp8``, as the FP8
        checkpoint `rlx.models.fp8.served` gives (its block and its quantised weights); ``int4``, `rlx.models.int4`.
        `adapters` (``train.lora.push: adapter``): pushes carry the actor's LoRA adapters, not weights (`_push_adapter`)."""
        self.trainer = trainer
        self.par = trainer.par
        self.plugins = plugins
        self.spec = transport_spec
        self.verify_weights = verify_weights  # "full", "sample" or "off"
        self.full_interval = full_interval
        self.engine_for = engine_for
        self.pushes = 0
        self.quantization = quantization
        self.adapters = adapters
        self.last_adapter: dict[str | None, Any] = {}  # rank 0: the adapters it last pushed (`push`'s `again`)
        self.fp8: tuple[tuple[int, int], set[str]] | None = None  # the served FP8 checkpoint's block and names
        self.transport: Transport | None = None
        self.ctx: TransportContext | None = None
        # each engine's dtype per tensor (None: it cannot say), asked at its first push after `setup`: set by how
        # the engine was launched, so not asked again at every push (an engine restarted or back gets a new setup:
        # `Weights.joins`)
        self.served: dict[str, dict[str, str] | None] = {}
        # one event loop for every call to the engines, and one kept-open client per engine on it: a push's calls
        # reuse their connections instead of opening one each (and a loop each)
        self.loop = asyncio.new_event_loop()

    @property
    def sending(self) -> bool:
        return self.par.sender

    def setup(self, engine_urls: list[str], output_dir: str, host: str) -> None:
        """Build the transport on each sender and set it up, one stage after another (see `push`). Called
        again when the engines change (one taken out, or back in), it closes the old transport first."""
        before = self.ctx.engines if self.ctx is not None else []
        if self.adapters and self.ctx is None and self.trainer.adapts_experts():  # (collective: every rank asks)
            raise RLXError("train.lora.push: adapter: the adapters on routed experts have no peft form for "
                           "transformers' fused experts, so engines cannot load them; push: merged serves them merged "
                           "(or leave gate_proj, up_proj and down_proj out of train.lora.target_modules)")
        if self.quantization == "fp8" and self.fp8 is None and self.sending:
            from rlx.models.fp8 import served, stored_quantised

            self.fp8 = stored_quantised(served(self.trainer.model_path, output_dir))
        engines = [self.engine_for(url) for url in engine_urls]
        self.served = {}
        if self.sending:  # each TP rank of an engine is a member of a weight-update group
            for e, tp in zip(engines, self.run(_tp_sizes(engines)), strict=True):
                e.tp_size = tp
        self.ctx = TransportContext(engines=engines, output_dir=Path(output_dir), sender=self.par.pp_rank,
                                    senders=self.par.pp, host=host)
        try:
            for stage in range(self.par.pp):
                if self.sending and self.par.pp_rank == stage:
                    self._agree(self._setup_transport)
                else:
                    self._agree(lambda: None)
        finally:
            self._close_clients(before)  # after the old transport closed (its close may call its engines)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the sender's event loop (every call to the engines goes through it). As `asyncio.run`,
        it cancels what `coro` left running (the other engines' calls of a gather that failed on one), so that
        nothing of a failed push runs on at the next call."""
        try:
            return self.loop.run_until_complete(coro)
        finally:
            left = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for t in left:
                t.cancel()
            if left:
                self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))

    def _setup_transport(self) -> None:
        if self.transport is not None:
            old, self.transport = self.transport, None
            try:
                self.run(old.close())
            except Exception as e:  # noqa: BLE001 - its engines may be the ones that died
                print(f"rlx: closing the previous weight transport: {e}", flush=True)
        self.transport = self.plugins.build("transports", self.spec)
        if self.adapters and not getattr(self.transport, "adapters", False):
            raise RLXError(f"weight_sync.transport {getattr(self.transport, 'name', self.spec)!r} does not carry LoRA adapters (train.lora.push: "
                           f"adapter): use tensor, disk or delta, or push: merged")
        transport, ctx = self._ready()
        if self.adapters and self.par.rank == 0:
            self.run(_serve_adapters(ctx.engines, self.trainer.tc.lora.rank))
        self.run(transport.setup(ctx))

    def _ready(self) -> tuple[Transport, TransportContext]:
        """The transport and its context, once `setup` has made them."""
        assert self.transport is not None and self.ctx is not None, "setup() first"
        return self.transport, self.ctx

    def push(self, version: int, adapters: dict[str | None, str] | None = None, again: bool = False) -> int:
        """Send the stages' weights one stage after another, let sender 0 commit `version`, then verify. Returns the
        bytes this rank sent. With adapter pushes, the actor's adapters, each under its name in `adapters`
        (`_push_adapter`).

        Stages take turns: an engine that serves weight requests one at a time (SGLang) could otherwise
        take two stages' broadcasts in different orders on different engines and wait forever. A failure
        on any rank fails the push on every rank (never a rank left waiting in a collective).
        """
        assert self.ctx is not None, "setup() first"
        if self.adapters:
            if not adapters:
                raise RLXError("train.lora.push: adapter: a push names the adapters the engines serve them as")
            return sum(self._push_adapter(version, key, name, again) for key, name in adapters.items())
        ctx = self.ctx
        full = self.verify_weights == "full" and self.pushes % self.full_interval == 0
        self.pushes += 1
        dtypes: dict[str, dict[str, str] | None] = {}

        def plan() -> None:  # which dtype each engine holds each tensor in
            if self.verify_weights != "off" and self.sending:
                new = [e for e in ctx.engines if e.url not in self.served]
                if new:
                    self.served.update(self.run(served_dtypes(new)))
                dtypes.update({e.url: self.served[e.url] for e in ctx.engines})

        self._agree(plan)
        prints = Fingerprints(plans=[d for d in dtypes.values() if d], full=full)
        sent = [0]
        for stage in range(self.par.pp):
            if self.par.pp_rank == stage:
                self._agree(self._send_stage, version, prints, sent)
            else:
                self._agree(lambda: None)
        self._agree(self._commit, version)
        if self.verify_weights != "off":
            check = verify(self.ctx.engines, prints, version, dtypes, full) if self.sending else None
            self._agree(lambda: self.run(check) if check is not None else None)
        return sent[0]

    def _push_adapter(self, version: int, key: str | None, name: str, again: bool) -> int:
        """The actor's LoRA adapter `key` (None: the one; multi-LoRA's by name), whole, from rank 0 (it is small): sent
        and committed as `Adapter` `name` for `version`, which engines serve beside the base model; then each engine
        is checked to report `version` and serve the adapter (its integrity the engine checks as it loads it, where
        the transport sends checksums). `again`: the adapter rank 0 last pushed, not the trainer's (to an engine back:
        the one requests name)."""
        tensors = self.last_adapter.get(key) if again else self.trainer.adapter_tensors(key)  # (collective unless again)
        sent = [0]

        def send() -> None:
            if self.par.rank != 0:
                return
            if tensors is None:
                raise RLXError("no LoRA adapter was pushed by this trainer yet, to push again")
            transport, ctx = self._ready()
            ctx = dataclasses.replace(ctx, senders=1, adapter=Adapter(name, self.trainer.adapter_config(tensors)))
            self.run(transport.send(iter(tensors.items()), version, ctx))
            self.run(transport.commit(version, ctx))
            sent[0] = sum(t.numel() * t.element_size() for t in tensors.values())
            if self.verify_weights != "off":
                self.run(verify_adapter(ctx.engines, name, version))
            self.last_adapter[key] = tensors

        self.pushes += 1
        self._agree(send)
        return sent[0]

    def _commit(self, version: int) -> None:
        if self.par.rank == 0:  # sender 0 commits for every stage
            transport, ctx = self._ready()
            self.run(transport.commit(version, ctx))

    def _send_stage(self, version: int, prints: Fingerprints, sent: list[int]) -> None:
        named = self.trainer.hf_tensors()
        try:
            if self.sending:
                transport, ctx = self._ready()
                stream: Iterator[tuple[str, Any]] = named
                if self.fp8 is not None:
                    from rlx.models.fp8 import quantized

                    stream = quantized(named, self.fp8[0], self.fp8[1].__contains__)
                elif self.quantization == "int4":
                    from rlx.models import int4

                    stream = int4.quantized(named)

                def counted() -> Iterator[tuple[str, Any]]:
                    for name, t in stream:
                        sent[0] += t.numel() * t.element_size()
                        yield name, t

                self.run(transport.send(prints.watch(counted()), version, ctx))
        finally:
            if self.par.gathers:
                for _ in named:  # finish the stage's tensor-parallel gathers, even after a failure
                    pass

    def _agree(self, fn: Callable[..., object], *args: Any) -> None:
        agree(self.par, fn, *args)

    def close(self) -> None:
        try:
            if self.transport is not None:
                self.run(self.transport.close())
        finally:
            self._close_clients(self.ctx.engines if self.ctx is not None else [])
            self.run(self.loop.shutdown_asyncgens())
            self.run(self.loop.shutdown_default_executor())
            self.loop.close()

    def _close_clients(self, engines: list[Any]) -> None:
        async def close() -> None:
            await asyncio.gather(*(e.close_clients() for e in engines), return_exceptions=True)

        if engines:
            self.run(close())


async def _serve_adapters(engines: list[Any], rank: int) -> None:
    """Every engine serves LoRA adapters of rank `rank` (SGLang's server info has its launch options): an engine
    attached by address may have been launched without them."""
    async def one(e) -> None:
        async with e.client(timeout_s=60) as c:
            info = await c.server_info()
        if not info.get("enable_lora"):
            raise RLXError(f"engine {e.url} does not serve LoRA adapters (launched without --enable-lora): "
                           f"train.lora.push: adapter needs --enable-lora --max-lora-rank {rank} --lora-target-modules "
                           f"... (rlx launches its own engines so), or use train.lora.push: merged")
        if (info.get("max_lora_rank") or rank) < rank:
            raise RLXError(f"engine {e.url} serves LoRA adapters of rank {info['max_lora_rank']} at most "
                           f"(--max-lora-rank); train.lora.rank is {rank}")

    await asyncio.gather(*(one(e) for e in engines))


def agree(par: Ranks, fn: Callable[..., object], *args: Any) -> None:
    """Run `fn` on this rank, then fail on every rank if it failed on any (no rank left in a barrier)."""
    import torch
    import torch.distributed as dist

    error: BaseException | None = None
    try:
        fn(*args)
    except Exception as e:  # re-raised below, on this rank as itself
        error = e
    if par.world == 1:  # no other rank to tell
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    dist.all_reduce(flag)
    if error is not None:
        raise error
    if int(flag.item()):
        raise RLXError("weight sync failed on another trainer rank (its error is reported by that rank)")
