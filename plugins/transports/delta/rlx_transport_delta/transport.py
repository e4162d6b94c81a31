"""The trainer side: publish each push as a full checkpoint or a lossless delta, then wait for the engines.

Every sending rank (one per pipeline stage) keeps, on CPU, the bytes it last published of its own tensors,
in the dtype the engines serve (``dtype``), and writes its part of version N into ``weight_v{N:06d}.tmp``
on the shared store: safetensors files for a full version (the first, and every ``full_every``-th), one
encoded file per tensor otherwise, and a part manifest. Sender 0's commit merges the parts into the
manifest, fsyncs and renames the folder (complete or absent), prunes what no engine can need, and waits
until every engine serves version N, reporting an agent's error (from its ``status.json``) as soon as it
appears. The engines' agents (`rlx_transport_delta.agent`) pull and apply versions themselves: with
``agents: local`` this transport starts one per engine on this host; ``agents: external`` expects them to
be run beside externally managed engines (``rl weights-agent``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from rlx.errors import RLXError

from rlx_transport_delta import codec


class DeltaTransport:
    name = "delta"
    adapters = True  # a LoRA adapter's versions are published as any (its manifest names it; agents load it as one)

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        path: str | None = None  # the shared store (default <output_dir>/weights-delta)
        dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # what engines serve; auto: ask
        # engines that say (the embedded engine), else each tensor's own dtype
        full_every: int = Field(50, ge=1)  # a full checkpoint every this many versions (and the first)
        keep_full: int = Field(1, ge=1)  # full versions kept (with every delta after the oldest kept)
        agents: Literal["local", "external"] = "local"  # start an agent per engine here, or expect them
        poll_s: float = Field(0.05, gt=0)  # how often local agents look for versions
        timeout_s: float = Field(600, gt=0)  # how long commit waits for the engines to serve a version
        zstd_level: int = Field(3, ge=1, le=19)

    root: Path  # the versions' folder, set by setup()

    def __init__(self, config: Config):
        self.config = config
        self.snapshot: dict[str, Any] = {}  # name -> bytes last published (numpy uint8)
        self.pushes = 0
        self.agents: list[Any] = []
        self.dtypes: dict[str, str] = {}
        self.stats: dict[str, float] = {}

    # -- setup -------------------------------------------------------------------------------------

    async def setup(self, ctx) -> None:
        self.root = Path(self.config.path) if self.config.path else Path(ctx.output_dir) / "weights-delta"
        self.root.mkdir(parents=True, exist_ok=True)
        if self.config.dtype == "auto":
            from rlx.transport.verify import served_dtypes

            plans = [p for p in (await served_dtypes(ctx.engines)).values() if p]
            for plan in plans:
                self.dtypes.update(plan)
        if ctx.sender == 0 and self.config.agents == "local":
            self._start_agents(ctx)

    def _start_agents(self, ctx) -> None:
        from rlx.rollout.engines.launch import ManagedProcess

        for i, e in enumerate(ctx.engines):
            local = Path(ctx.output_dir) / "delta-agents" / f"engine-{i}-{codec.engine_slug(e.url)}"
            cmd = [sys.executable, "-m", "rlx_transport_delta.agent", "--source", str(self.root), "--local",
                   str(local), "--engine", e.url, "--poll-s", str(self.config.poll_s)]
            proc = ManagedProcess(cmd, Path(ctx.output_dir) / "logs" / f"{local.name}.log")
            proc.start()
            self.agents.append(proc)

    # -- a push ------------------------------------------------------------------------------------

    def _dtype_for(self, name: str, t: Any) -> str:
        if self.config.dtype != "auto":
            return self.config.dtype
        return self.dtypes.get(name) or str(t.dtype).removeprefix("torch.")

    async def send(self, named, version: int, ctx) -> None:
        import torch
        from safetensors.torch import save_file

        full = self.pushes % self.config.full_every == 0 or not self.snapshot
        if ctx.sender == 0:
            self._drop_newer(version)
        tmp = self.root / (codec.folder_name(version) + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        mine = f"s{ctx.sender:02d}"
        for stale in tmp.iterdir():  # this sender's files from an attempt that died before its commit; the
            if f"-{mine}-" in stale.name or stale.name == f"part-{mine}.json":  # other senders' are theirs
                stale.unlink()
        part: dict[str, Any] = {}
        encode_s, written, raw_total = 0.0, 0, 0
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, shard_index = 0, 0

        def flush_shard() -> None:
            nonlocal shard, shard_bytes, shard_index, written
            if not shard:
                return
            fname = f"model-s{ctx.sender:02d}-{shard_index:05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            written += (tmp / fname).stat().st_size
            for n in shard:
                part[n]["file"] = fname
            shard, shard_bytes, shard_index = {}, 0, shard_index + 1

        for i, (name, t) in enumerate(named):
            dtype = self._dtype_for(name, t)
            tensor = t.detach().to(getattr(torch, dtype)).contiguous().cpu()
            raw = codec.to_bytes(tensor)
            raw_total += raw.size
            entry = {"shape": list(tensor.shape), "dtype": dtype, "nbytes": int(raw.size),
                     "itemsize": tensor.element_size(), "checksum": codec.checksum(raw)}
            if full:
                entry["encoding"] = "safetensors"
                part[name] = entry
                shard[name] = tensor
                shard_bytes += raw.size
                if shard_bytes >= 1 << 30:
                    flush_shard()
            else:
                t0 = time.perf_counter()
                encoding, blob = await asyncio.to_thread(codec.encode, raw, self.snapshot.get(name),
                                                         tensor.element_size(), self.config.zstd_level)
                encode_s += time.perf_counter() - t0
                fname = f"t-s{ctx.sender:02d}-{i:05d}.zst"
                codec.write_file(tmp / fname, blob)
                written += len(blob)
                part[name] = {**entry, "encoding": encoding, "file": fname}
            self.snapshot[name] = raw
        flush_shard()
        codec.write_file(tmp / f"part-s{ctx.sender:02d}.json", json.dumps(part).encode())
        self.pushes += 1
        self.stats = {"full": float(full), "published_bytes": float(written), "raw_bytes": float(raw_total),
                      "encode_s": encode_s}

    def _drop_newer(self, version: int) -> None:
        """Versions >= `version` in the store were published by an earlier run (this one resumed from an
        earlier checkpoint, or reuses the store): remove them, so that agents follow this run."""
        for v, folder in codec.published(self.root).items():
            if v >= version:
                print(f"delta transport: removing {folder}, published before this run's version {version}",
                      file=sys.stderr, flush=True)
                codec.remove_folder(folder)

    async def commit(self, version: int, ctx) -> None:
        """Publish version N (every sender has sent its part) and wait until every engine serves it."""
        final = self.publish(version, ctx)
        await self._wait_served(version, codec.read_manifest(final)["id"], ctx)

    def publish(self, version: int, ctx) -> Path:
        """Merge the senders' parts into the manifest and make the version folder appear, complete; prune."""
        tmp = self.root / (codec.folder_name(version) + ".tmp")
        parts = sorted(tmp.glob("part-s*.json")) if tmp.is_dir() else []
        expected = [f"part-s{i:02d}.json" for i in range(ctx.senders)]
        if [p.name for p in parts] != expected:
            raise RLXError(f"delta transport: version {version} has parts {[p.name for p in parts]} in {tmp}, "
                           f"expected {expected} (a sender failed, senders do not share this store, or an "
                           f"earlier attempt with another number of pipeline stages left its parts: remove {tmp})")
        tensors: dict[str, Any] = {}
        for p in parts:  # the parts stay in the folder: a commit retried after a crash finds them again
            tensors.update(json.loads(p.read_text()))
        encodings = {e["encoding"] for e in tensors.values()}
        if "safetensors" in encodings and encodings != {"safetensors"}:
            raise RLXError(f"delta transport: the senders of version {version} disagree on whether it is a full "
                           f"version (they must push the same number of times; after a restart every sender "
                           f"starts with a full version)")
        kind = "full" if encodings <= {"safetensors"} else "delta"
        base = None if kind == "full" else self._previous(version)
        adapter = ctx.adapter and {"name": ctx.adapter.name, "config": ctx.adapter.config}
        manifest = {"format": codec.FORMAT, "version": version, "id": uuid.uuid4().hex, "kind": kind, "adapter": adapter,
                    "base": base, "base_id": None if base is None else
                    codec.read_manifest(self.root / codec.folder_name(base)).get("id"), "tensors": tensors}
        final = self.root / codec.folder_name(version)
        codec.finish_folder(tmp, final, manifest)
        self._prune()
        return final

    def _previous(self, version: int) -> int:
        older = [v for v in codec.published(self.root) if v < version]
        if not older:
            raise RLXError(f"delta transport: version {version} is a delta but no earlier version is published")
        return older[-1]

    def _prune(self) -> None:
        """Keep the newest `keep_full` full versions and everything after the oldest of them: an agent behind
        those can always re-seed from a full version."""
        versions = codec.published(self.root)
        fulls = [v for v, p in versions.items() if codec.read_manifest(p)["kind"] == "full"]
        if len(fulls) <= self.config.keep_full:
            return
        oldest_kept = fulls[-self.config.keep_full]
        for v, p in versions.items():
            if v < oldest_kept:
                codec.remove_folder(p)

    async def _wait_served(self, version: int, publication: str, ctx) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        pending = list(ctx.engines)
        while pending:
            still = []
            for e in pending:
                async with e.client(timeout_s=30) as c:
                    if await c.weight_version() == str(version):
                        continue
                status = self._agent_status(e.url)
                if status.get("error") and status.get("for_id") == publication:
                    raise RLXError(f"delta transport: the weights agent of engine {e.url} failed on version "
                                   f"{version}: {status['error']} (the engine keeps serving version "
                                   f"{status.get('version')})")
                still.append(e)
            for proc in self.agents:
                if not proc.alive():
                    raise RLXError(f"delta transport: a weights agent exited with code {proc.returncode}; "
                                   f"log {proc.log_path}:\n{proc.log_tail()}")
            pending = still
            if pending and time.monotonic() > deadline:
                raise RLXError(f"delta transport: engines {[e.url for e in pending]} do not serve version {version} "
                               f"after {self.config.timeout_s:.0f}s; is a weights agent running beside each "
                               f"(rl weights-agent --source {self.root} --local DIR --engine URL)?")
            if pending:
                await asyncio.sleep(0.02)

    def _agent_status(self, url: str) -> dict[str, Any]:
        try:
            return json.loads((self.root / "agents" / f"{codec.engine_slug(url)}.json").read_text())
        except (OSError, ValueError):
            return {}

    async def close(self) -> None:
        for proc in self.agents:
            proc.stop()
        self.agents = []
