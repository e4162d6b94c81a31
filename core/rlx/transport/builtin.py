"""The built-in weight transports: tensor (serialized tensors over HTTP, CUDA IPC handles on GPU), broadcast
(a torch.distributed group between each sending rank and the engines, bucketed) and disk (an HF
safetensors folder per version on storage the engines share).

Each follows the push protocol of `rlx.transport`: every sending rank (one per pipeline stage) sends
its part, then sender 0 commits the version.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl
from rlx.errors import EngineError
from rlx.hookspecs import RegisterTransports
from rlx.lazy import lazy_module
from rlx.net import free_port
from rlx.transport import buckets, serve_adapter, update_sessions
from rlx.transport.group import engine_ranks, open_group

if TYPE_CHECKING:
    import torch

    from rlx.transport.shm import Segment
else:
    torch = lazy_module("torch")  # the plugins load this module without torch (`rlx.lazy`)


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bucket_mb: int = Field(512, ge=1)  # tensors per request or broadcast round, by size


async def _set_version(engines, version: int) -> None:
    async def one(e):
        async with e.client() as c:
            await c.update_weight_version(str(version))

    await asyncio.gather(*(one(e) for e in engines))


def _with_last(items):
    """(item, whether it is the last) for each of `items`, taken lazily."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


async def _reads_segments(engine) -> bool:
    """Whether an engine takes rlx's shared-memory handles: only rlx's embedded engine does. SGLang's loader
    refuses the handle's class, and its scheduler dies of it (0.5.23, seen live): SGLang gets bytes by value."""
    async with engine.client(timeout_s=60) as c:
        return (await c.server_info()).get("engine") == "rlx-embedded"


class TensorTransport:
    """Tensors through the engines' ``/update_weights_from_tensor``: CUDA IPC handles on GPU; on CPU, handles
    into a shared-memory segment for engines on this host (`rlx.transport.shm`) and bytes by value (pickled,
    base64 in JSON: slow) for engines elsewhere."""

    name = "tensor"
    adapters = True  # LoRA adapters through /load_lora_adapter_from_tensors, by value, checked by the engine

    class Config(_Args):
        shared_memory: bool = True  # CPU tensors to engines on this host through /dev/shm (false: by value)

    def __init__(self, config: Config):
        self.config = config
        self.adapter: dict[str, torch.Tensor] = {}  # an adapter push's tensors, until its commit
        self.segment: Segment | None = None
        self.local: set[str] = set()  # urls of the engines that read the segment
        self.versioned: int | None = None  # the version the last send set on every engine (sole sender)

    async def setup(self, ctx) -> None:
        from rlx.transport.shm import Segment  # torch: not when the plugins load (`rlx.lazy`)

        here = {"127.0.0.1", "localhost", "::1", ctx.host}
        near = [e for e in ctx.engines if urlsplit(e.url).hostname in here] if self.config.shared_memory else []
        readers = await asyncio.gather(*(_reads_segments(e) for e in near))
        self.local = {e.url for e, reads in zip(near, readers, strict=True) if reads}
        if self.local and self.segment is None:
            self.segment = Segment()
        far = len(ctx.engines) - len(self.local)
        print(f"rlx: weight transport tensor: CPU tensors through shared memory to {len(self.local)} engine(s) on "
              f"this host, by value to {far}; CUDA tensors as IPC handles", flush=True)

    async def send(self, named, version: int, ctx) -> None:
        from rlx.transport.payloads import serialize_named_tensors  # torch: not when the plugins load

        if ctx.adapter is not None:  # (small: loaded whole at the commit)
            self.adapter = dict(named)
            return
        # the only sender sets the version with its last bucket, which is then the commit (one call fewer)
        self.versioned = None
        sole = ctx.senders == 1
        async with update_sessions(ctx.engines):
            for bucket, last in _with_last(buckets(named, self.config.bucket_mb << 20)):
                stamp = str(version) if sole and last else None
                payloads = {}
                if self.local:
                    payloads[True] = serialize_named_tensors(bucket, self.segment)
                if len(self.local) < len(ctx.engines):
                    payloads[False] = serialize_named_tensors(bucket)

                async def one(e, payloads=payloads, bucket=bucket):
                    local = e.url in self.local
                    tp = getattr(e, "tp_size", 1)  # every TP rank of the engine reads its own element
                    async with e.client() as c:
                        try:
                            await c.update_weights_from_tensor([payloads[local]] * tp, weight_version=stamp)
                            return
                        except EngineError as err:
                            if not local:
                                raise
                            # an engine that cannot read the segment (its own /dev/shm in a container, or an
                            # engine that only takes tensors by value): by value for it from now on
                            print(f"rlx: engine {e.url} did not take weights through shared memory ({err}); "
                                  f"sending it tensors by value", flush=True)
                            self.local.discard(e.url)
                        await c.update_weights_from_tensor([payloads.get(False) or serialize_named_tensors(bucket)]
                                                           * tp, weight_version=stamp)

                await asyncio.gather(*(one(e) for e in ctx.engines))
        self.versioned = version if sole else None

    async def commit(self, version: int, ctx) -> None:
        if ctx.adapter is not None:
            from rlx.transport.payloads import serialize_tensor_dict, sha256

            tensors, self.adapter = self.adapter, {}
            payload, sums = serialize_tensor_dict(tensors), {n: sha256(t) for n, t in tensors.items()}
            await serve_adapter(ctx.engines, ctx.adapter.name, version, lambda c, e: c.load_lora_adapter_from_tensors(
                ctx.adapter.name, ctx.adapter.config, [payload] * getattr(e, "tp_size", 1), sums))
        elif self.versioned != version:
            await _set_version(ctx.engines, version)

    async def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class DiskTransport:
    """An HF safetensors folder per version (each sender writes its own files); engines reload it."""

    name = "disk"
    adapters = True  # LoRA adapters as peft folders, through /load_lora_adapter

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        path: str | None = None  # folder for the versions (default <output_dir>/weights)
        keep: int = Field(2, ge=1)  # versions kept on disk
        shard_mb: int = Field(1024, ge=1)  # at most this many MB per safetensors file

    root: Path  # the versions' folder, set by setup()

    def __init__(self, config: Config):
        self.config = config

    async def setup(self, ctx) -> None:
        self.root = Path(self.config.path) if self.config.path else Path(ctx.output_dir) / "weights"
        self.root.mkdir(parents=True, exist_ok=True)

    def folder(self, version: int, ctx: Any = None) -> Path:
        """Version `version`'s folder; an adapter push's (``ctx.adapter``), the adapter's own in it (several adapters
        go out at one version: multi-LoRA)."""
        folder = self.root / f"v{version}"
        return folder / ctx.adapter.name if ctx is not None and ctx.adapter is not None else folder

    async def send(self, named, version: int, ctx) -> None:
        from safetensors.torch import save_file  # torch: not when the plugins load

        folder = self.folder(version, ctx)
        folder.mkdir(parents=True, exist_ok=True)
        if ctx.adapter is not None:  # peft's folder, as SGLang loads it
            from rlx.transport.payloads import save_peft_adapter

            await asyncio.to_thread(save_peft_adapter, folder, dict(named), ctx.adapter.config)
            return
        for i, bucket in enumerate(buckets(named, self.config.shard_mb << 20)):
            tensors = {n: t.detach().contiguous().cpu() for n, t in bucket}
            await asyncio.to_thread(save_file, tensors, str(folder / f"model-s{ctx.sender:02d}-{i:05d}.safetensors"))

    async def commit(self, version: int, ctx) -> None:
        folder = self.folder(version, ctx)

        async def one(e):
            async with e.client() as c:
                await c.update_weights_from_disk(str(folder), weight_version=str(version))

        if ctx.adapter is not None:
            await serve_adapter(ctx.engines, ctx.adapter.name, version,
                                lambda c, e: c.load_lora_adapter(ctx.adapter.name, str(folder)))
        else:
            await asyncio.gather(*(one(e) for e in ctx.engines))
        versions = sorted((p for p in self.root.glob("v*") if p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
        for old in versions[: -self.config.keep]:
            shutil.rmtree(old, ignore_errors=True)

    async def close(self) -> None:
        pass


_SETUPS = itertools.count()  # broadcast groups set up in this process


class BroadcastTransport:
    """Each sender is rank 0 of a group with every TP rank of every engine (`rlx.transport.group`, SGLang's
    layout); tensors are broadcast one by one in the order named, a bucket per update request."""

    name = "broadcast"
    Config = _Args

    def __init__(self, config: _Args):
        self.config = config
        self.pg = None
        self.group_name = "rlx-weights"
        self.engines: list = []

    async def setup(self, ctx) -> None:
        # a new name each setup: the transport is set up again when engines leave or rejoin, and SGLang
        # refuses a group name it already has
        self.group_name = f"rlx-weights-{ctx.sender}-{next(_SETUPS)}"
        self.engines = list(ctx.engines)
        port = free_port(ctx.host)
        offsets, world = engine_ranks([getattr(e, "tp_size", 1) for e in ctx.engines])
        backend = "nccl" if torch.cuda.is_available() else "gloo"

        async def join(offset, e):
            async with e.client() as c:
                await c.init_weights_update_group(ctx.host, port, offset, world, self.group_name, backend)

        # The engines' joins and ours meet in the store: both must be under way at once.
        pg_task = asyncio.create_task(asyncio.to_thread(open_group, ctx.host, port, 0, world, self.group_name,
                                                        backend, 300))
        try:
            await asyncio.gather(*(join(o, e) for o, e in zip(offsets, ctx.engines, strict=True)))
        except BaseException:
            pg_task.cancel()
            raise
        self.pg = await pg_task

    async def send(self, named, version: int, ctx) -> None:
        async with update_sessions(ctx.engines):
            for bucket in buckets(named, self.config.bucket_mb << 20):
                names = [n for n, _ in bucket]
                dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
                shapes = [list(t.shape) for _, t in bucket]

                async def one(e):
                    async with e.client() as c:
                        await c.update_weights_from_distributed(names, dtypes, shapes, self.group_name)

                requests = [asyncio.create_task(one(e)) for e in ctx.engines]

                def send():
                    for _, t in bucket:
                        self.pg.broadcast(t.detach().contiguous(), 0).wait()

                await asyncio.to_thread(send)
                await asyncio.gather(*requests)

    async def commit(self, version: int, ctx) -> None:
        await _set_version(ctx.engines, version)

    async def close(self) -> None:
        """Leave the group on the engines (best effort: some may be dead) and here."""
        async def leave(e):
            async with e.client(timeout_s=30) as c:
                await c.destroy_weights_update_group(self.group_name)

        if self.pg is not None:
            await asyncio.gather(*(leave(e) for e in self.engines), return_exceptions=True)
        self.pg, self.engines = None, []


@hookimpl
def register_transports(register: RegisterTransports) -> None:
    for cls in (TensorTransport, DiskTransport, BroadcastTransport):
        register(cls)
