"""The engine side: a weights agent beside each engine host, with no change to the engine.

It keeps a host-local checkpoint (``<local>/weight_v{N:06d}/``, safetensors) of the version its engine
serves, pulls the versions it lacks from the shared store (a fresh host, or one whose next delta is gone,
seeds from the newest full version), applies each delta to its copy, checks every tensor's checksum, writes
the new local checkpoint (complete or absent: written as ``.tmp``, fsynced, renamed), and only then asks the
engine to load it with its stock ``/update_weights_from_disk`` and the new weight version (a version that is a LoRA
adapter, ``train.lora.push: adapter``, is written as a peft folder and loaded with ``/load_lora_adapter`` under the name
its manifest gives). Generation goes
on while it pulls and applies; only the engine's reload pauses it. Any failure (a checksum mismatch, a
missing version, an unreachable store or engine) is logged loudly and written to ``<local>/status.json``
(which the trainer's commit reads), and the engine keeps serving the last good version.

    rl weights-agent --source DIR --local DIR --engine URL      (or python -m rlx_transport_delta.agent)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rlx_transport_delta import codec
from rlx_transport_delta.codec import DeltaError


class Agent:
    def __init__(self, source: Path, local: Path, engine: str, poll_s: float = 0.05):
        self.source, self.local, self.engine, self.poll_s = Path(source), Path(local), engine.rstrip("/"), poll_s
        self.local.mkdir(parents=True, exist_ok=True)
        for tmp in self.local.glob("*.tmp"):  # left by an agent killed mid-apply: never used
            shutil.rmtree(tmp, ignore_errors=True)
        self.version: int | None = None
        self.id: str | None = None  # the publication id of the local version (a version number can be
        # published again, by a run resumed from an earlier checkpoint: the id tells them apart)
        self.engine_checked = False
        self.tensors: dict[str, Any] = {}  # name -> bytes of the local version (numpy uint8)
        self.meta: dict[str, Any] = {}  # name -> manifest entry of the local version
        self.adapter: dict[str, Any] | None = None  # the local version's LoRA adapter ({name, config}), if it is one
        self.last_error: str | None = None
        self._load_local()

    # -- local state -------------------------------------------------------------------------------

    def _load_local(self) -> None:
        state = self.local / "state.json"
        if not state.is_file():
            return
        v = json.loads(state.read_text())["version"]
        folder = self.local / codec.folder_name(v)
        if not folder.is_dir():
            return
        m = codec.read_manifest(folder)
        self._read_checkpoint(folder, m)
        self.version, self.id, self.adapter = v, m.get("id"), m.get("adapter")

    def _read_checkpoint(self, folder: Path, manifest: dict[str, Any]) -> None:
        """Load a full checkpoint's tensors as bytes, each checked against the manifest."""
        from safetensors.torch import load_file

        files: dict[str, dict[str, Any]] = {}
        tensors, meta = {}, {}
        for name, entry in manifest["tensors"].items():
            if entry["file"] not in files:
                try:
                    files[entry["file"]] = load_file(str(folder / entry["file"]))
                except Exception as e:
                    raise DeltaError(f"{folder / entry['file']}: unreadable ({type(e).__name__}: {e})") from None
            if name not in files[entry["file"]]:
                raise DeltaError(f"{folder / entry['file']}: no tensor {name!r}")
            raw = codec.to_bytes(files[entry["file"]][name])
            if codec.checksum(raw) != entry["checksum"]:
                raise DeltaError(f"version {manifest['version']}: tensor {name!r} does not match its checksum")
            tensors[name] = raw
            meta[name] = {k: entry[k] for k in ("shape", "dtype", "nbytes", "itemsize", "checksum")}
        self.tensors, self.meta = tensors, meta

    def _write_local(self, version: int) -> Path:
        from safetensors.torch import save_file

        final = self.local / codec.folder_name(version)
        tmp = self.local / (codec.folder_name(version) + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        tensors = {n: codec.from_bytes(raw, self.meta[n]["dtype"], self.meta[n]["shape"], copy=False)
                   for n, raw in self.tensors.items()}
        file = "adapter_model.safetensors" if self.adapter else "model.safetensors"
        _fault("write", tmp / file)
        if self.adapter:  # a peft folder, as engines load adapters
            from rlx.transport.payloads import save_peft_adapter

            save_peft_adapter(tmp, tensors, self.adapter["config"])
        else:
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        manifest = {"format": codec.FORMAT, "version": version, "id": self.id, "kind": "full", "base": None,
                    "adapter": self.adapter,
                    "tensors": {n: {**m, "encoding": "safetensors", "file": file} for n, m in self.meta.items()}}
        codec.finish_folder(tmp, final, manifest)
        return final

    # -- pulling -----------------------------------------------------------------------------------

    def plan(self) -> list[int]:
        """The versions to apply, in order, to reach the newest published one."""
        versions = codec.published(self.source)
        if not versions:
            return []
        newest = max(versions)
        if newest == self.version and codec.read_manifest(versions[newest]).get("id") == self.id:
            return []
        chain, v = [], newest
        while True:  # walk back from the newest to what we hold or to a full version
            if v not in versions:
                raise DeltaError(f"version {v} is missing from {self.source} (deleted, or never published)")
            m = codec.read_manifest(versions[v])
            chain.append(v)
            if m["kind"] == "full" or (m.get("base") == self.version and m.get("base_id") == self.id):
                break
            if m.get("base") is None:
                raise DeltaError(f"version {v}: a delta without a base")
            v = m["base"]
        return chain[::-1]

    def apply(self, version: int) -> None:
        """Apply one published version to the local tensors (nothing changes if it fails)."""
        folder = self.source / codec.folder_name(version)
        m = codec.read_manifest(folder)
        if m["kind"] == "full":
            self._read_checkpoint(folder, m)
            self.version, self.id, self.adapter = version, m.get("id"), m.get("adapter")
            return
        if m.get("base") != self.version or m.get("base_id") != self.id:
            raise DeltaError(f"version {version} is a delta on version {m.get('base')} (publication "
                             f"{m.get('base_id')}), but this host has version {self.version} ({self.id})")
        new_tensors, new_meta = dict(self.tensors), dict(self.meta)
        for name, entry in m["tensors"].items():
            try:
                blob = (folder / entry["file"]).read_bytes()
            except FileNotFoundError:
                raise DeltaError(f"version {version}: file {entry['file']} of {name!r} is missing") from None
            old = self.tensors.get(name)
            raw = codec.decode(entry["encoding"], blob, old, entry["nbytes"], entry["itemsize"])
            if codec.checksum(raw) != entry["checksum"]:
                raise DeltaError(f"version {version}: tensor {name!r} does not match its checksum after applying "
                                 f"the delta (corrupt data, or a base that differs from the publisher's)")
            new_tensors[name] = raw
            new_meta[name] = {k: entry[k] for k in ("shape", "dtype", "nbytes", "itemsize", "checksum")}
        self.tensors, self.meta = new_tensors, new_meta
        self.version, self.id, self.adapter = version, m.get("id"), m.get("adapter")

    async def step(self) -> int | None:
        """Bring the engine to the newest published version; returns the version now served (None: nothing
        to do). Raises on any failure, having changed neither the engine nor the local state."""
        if not self.engine_checked:
            await self._check_engine()
        chain = self.plan()
        if not chain:
            return None
        before = (self.version, self.id, self.tensors, self.meta, self.adapter)
        try:
            t0 = time.perf_counter()
            for v in chain:
                self.apply(v)
            target = chain[-1]
            folder = self._write_local(target)
            applied = time.perf_counter() - t0
            t1 = time.perf_counter()
            await self._reload(folder, target)
            reload_s = time.perf_counter() - t1
        except BaseException:
            self.version, self.id, self.tensors, self.meta, self.adapter = before
            raise
        codec.write_file(self.local / "state.json.tmp", json.dumps({"version": target, "id": self.id}).encode())
        os.replace(self.local / "state.json.tmp", self.local / "state.json")
        for old in self.local.glob("weight_v*"):  # earlier copies, and any a failed reload left behind
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        self._status(None, target, self.id, pull_apply_s=applied, reload_s=reload_s)
        return target

    async def _check_engine(self) -> None:
        """Once, at start: an engine that does not serve this host's version (it restarted, or another agent
        ran) gets the local checkpoint again."""
        from rlx.rollout.engines.client import EngineClient

        if self.version is not None:
            async with EngineClient(self.engine, timeout_s=60) as c:
                served = await c.weight_version()
            if served != str(self.version):
                print(f"rlx weights-agent: engine {self.engine} serves version {served!r}, this host holds "
                      f"{self.version}: reloading it", file=sys.stderr, flush=True)
                await self._reload(self.local / codec.folder_name(self.version), self.version)
        self.engine_checked = True

    async def _reload(self, folder: Path, version: int) -> None:
        from rlx.rollout.engines.client import EngineClient

        adapter = codec.read_manifest(folder).get("adapter")
        async with EngineClient(self.engine, timeout_s=600) as c:
            if adapter:
                from rlx.transport import served_adapters

                if adapter["name"] not in await served_adapters(c):  # (an engine checked again may have it)
                    await c.load_lora_adapter(adapter["name"], str(folder))
                await c.update_weight_version(str(version))
            else:
                await c.update_weights_from_disk(str(folder), weight_version=str(version))

    def _status(self, error: str | None, for_version: int | None, for_id: str | None, **figures: float) -> None:
        """Write what this agent serves and its last error beside its checkpoint and into the store
        (``agents/<engine>.json``), where the trainer's commit reads it, wherever the agent runs."""
        body = {"engine": self.engine, "version": self.version, "id": self.id, "error": error,
                "for_version": for_version, "for_id": for_id, "time": time.time(), **figures}
        data = json.dumps(body).encode()
        for path in (self.local / "status.json", self.source / "agents" / f"{codec.engine_slug(self.engine)}.json"):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
                codec.write_file(tmp, data)
                os.replace(tmp, path)
            except OSError as e:  # an unreachable store must not hide the error being reported
                print(f"rlx weights-agent: cannot write {path}: {e}", file=sys.stderr, flush=True)

    async def run(self, once: bool = False) -> int:
        """Poll the store; with `once`, bring the engine up to date and return (1 on failure)."""
        while True:
            try:
                await self.step()
                self.last_error = None
                if once:
                    return 0
            except Exception as e:
                message = f"{type(e).__name__}: {e}"
                newest, newest_id = self._newest()
                if message != self.last_error:
                    print(f"rlx weights-agent: ERROR for engine {self.engine}: {message}; it keeps serving "
                          f"version {self.version}", file=sys.stderr, flush=True)
                self.last_error = message
                self._status(message, newest, newest_id)
                if once:
                    return 1
            await asyncio.sleep(self.poll_s)


    def _newest(self) -> tuple[int | None, str | None]:
        """The newest published version and its publication id (None where they cannot be read)."""
        try:
            versions = codec.published(self.source)
            if not versions:
                return None, None
            newest = max(versions)
            return newest, codec.read_manifest(versions[newest]).get("id")
        except (OSError, DeltaError):
            return None, None


def _fault(stage: str, path: Path) -> None:
    """Fault injection for tests: ``RLX_DELTA_AGENT_FAULT=write`` kills the agent (exit 137) half way through
    writing a local checkpoint, as a kill -9 would."""
    if os.environ.get("RLX_DELTA_AGENT_FAULT") == stage:
        path.write_bytes(b"\0" * 4096)
        os._exit(137)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rl weights-agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="the shared store the trainer publishes versions to")
    p.add_argument("--local", required=True, help="a host-local folder for this engine's checkpoint")
    p.add_argument("--engine", required=True, help="the engine's base URL")
    p.add_argument("--poll-s", type=float, default=0.5)
    p.add_argument("--once", action="store_true", help="update the engine once and exit (1 on failure)")
    args = p.parse_args(argv)
    agent = Agent(Path(args.source), Path(args.local), args.engine, args.poll_s)
    try:
        return asyncio.run(agent.run(once=args.once))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
