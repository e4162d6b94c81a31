"""Built-in weight transports: tensor (in process, or CUDA IPC when colocated), broadcast (a
torch.distributed group between trainer and engines, bucketed) and disk (an HF safetensors folder)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from rlx import hookimpl


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bucket_mb: int = Field(512, ge=1)  # tensors per request or broadcast round, by size


class TensorTransport:
    """Serialized tensors over the engines' HTTP API: by value on CPU, CUDA IPC handles on GPU."""

    name = "tensor"
    Config = _Args

    def __init__(self, config: _Args):
        self.config = config

    async def setup(self, engines, output_dir: Path) -> None:
        pass

    async def push(self, named, version: int, engines) -> None:
        from rlx.rollout.engines.embedded.weights import serialize_named_tensors
        from rlx.transport import buckets

        parts = buckets(named, self.config.bucket_mb << 20)
        for i, bucket in enumerate(parts):
            payload = serialize_named_tensors(bucket)
            last = str(version) if i == len(parts) - 1 else None

            async def one(e, payload=payload, last=last):
                async with e.client() as c:
                    await c.update_weights_from_tensor([payload], weight_version=last)

            await asyncio.gather(*(one(e) for e in engines))

    async def close(self) -> None:
        pass


class DiskTransport:
    """An HF safetensors folder per version under the run's output dir; engines reload it."""

    name = "disk"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        path: str | None = None  # folder for the versions (default <output_dir>/weights)
        keep: int = Field(2, ge=1)  # versions kept on disk

    def __init__(self, config: Config):
        self.config = config
        self.root: Path | None = None

    async def setup(self, engines, output_dir: Path) -> None:
        self.root = Path(self.config.path) if self.config.path else Path(output_dir) / "weights"
        self.root.mkdir(parents=True, exist_ok=True)

    async def push(self, named, version: int, engines) -> None:
        from safetensors.torch import save_file

        assert self.root is not None, "setup() first"
        folder = self.root / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(save_file, {n: t.detach().contiguous().cpu() for n, t in named},
                                str(folder / "model.safetensors"))

        async def one(e):
            async with e.client() as c:
                await c.update_weights_from_disk(str(folder), weight_version=str(version))

        await asyncio.gather(*(one(e) for e in engines))
        versions = sorted((p for p in self.root.glob("v*") if p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
        for old in versions[: -self.config.keep]:
            shutil.rmtree(old, ignore_errors=True)

    async def close(self) -> None:
        pass


class BroadcastTransport:
    """The trainer is rank 0 of a group with every engine (ranks 1..n); tensors are broadcast in buckets."""

    name = "broadcast"
    Config = _Args

    def __init__(self, config: _Args):
        self.config = config
        self.pg = None
        self.group_name = "rlx-weights"

    async def setup(self, engines, output_dir: Path) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from rlx.rollout.engines.launch import HOST, free_port

        port = free_port()
        world = len(engines) + 1
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = dist.PrefixStore(self.group_name, dist.TCPStore(HOST, port, world, is_master=True,
                                                                timeout=timedelta(seconds=300), wait_for_workers=False))

        def make():
            if backend == "gloo":
                return dist.ProcessGroupGloo(store, 0, world, timedelta(seconds=300))
            return dist.ProcessGroupNCCL(store, 0, world)

        async def join(i, e):
            async with e.client() as c:
                await c.init_weights_update_group(HOST, port, i + 1, world, self.group_name, backend)

        pg_task = asyncio.create_task(asyncio.to_thread(make))
        await asyncio.gather(*(join(i, e) for i, e in enumerate(engines)))
        self.pg = await pg_task

    async def push(self, named, version: int, engines) -> None:
        from rlx.transport import buckets

        parts = buckets(named, self.config.bucket_mb << 20)
        for i, bucket in enumerate(parts):
            last = str(version) if i == len(parts) - 1 else None
            names = [n for n, _ in bucket]
            dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]

            async def one(e):
                async with e.client() as c:
                    await c.update_weights_from_distributed(names, dtypes, shapes, self.group_name, last)

            requests = [asyncio.create_task(one(e)) for e in engines]

            def send():
                for _, t in bucket:
                    self.pg.broadcast(t.detach().contiguous(), 0).wait()

            await asyncio.to_thread(send)
            await asyncio.gather(*requests)

    async def close(self) -> None:
        self.pg = None


@hookimpl
def register_transports(register):
    for cls in (TensorTransport, DiskTransport, BroadcastTransport):
        register(cls)
