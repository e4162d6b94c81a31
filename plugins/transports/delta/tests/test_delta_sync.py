"""The delta transport against the embedded engine, which answers SGLang's API: 50 bit-exact pushes of a
bf16-serving engine from fp32 masters, every failure loud with the engine still on its last good version,
and an engine started by hand with its agent, training end to end through ``rollout.external_engines``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from rlx.errors import RLXError
from rlx.models.tiny import resolve_model_path
from rlx.rollout.engines.fleet import Engine
from rlx.rollout.engines.launch import (
    HOST,
    ManagedProcess,
    embedded_command,
    free_port,
    wait_healthy,
)
from rlx.testing.contracts import TransportContract
from rlx.transport import TransportContext
from rlx.transport.payloads import tensor_hash
from rlx_transport_delta import codec
from rlx_transport_delta.agent import Agent
from rlx_transport_delta.codec import DeltaError
from rlx_transport_delta.transport import DeltaTransport
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

AGENT = [sys.executable, "-m", "rlx_transport_delta.agent"]


class TestDeltaContract(TransportContract):
    transport_name = "delta"


@pytest.fixture(scope="module")
def model_path():
    return resolve_model_path("builtin://tiny-qwen3")


def start_engine(model_path: str, folder: Path, dtype: str = "float32") -> tuple[Engine, ManagedProcess]:
    port = free_port()
    proc = ManagedProcess(embedded_command(model_path, port, server_args={"num_threads": 1, "dtype": dtype}),
                          folder / f"engine-{port}.log")
    proc.start()
    engine = Engine(f"http://{HOST}:{port}", "target")
    asyncio.run(wait_healthy(engine.url, proc, 120))
    return engine, proc


@pytest.fixture
def bf16_engine(model_path, tmp_path):
    engine, proc = start_engine(model_path, tmp_path, "bfloat16")
    yield engine
    proc.stop()


async def served(engine: Engine, names: list[str]) -> tuple[str, dict[str, str]]:
    async with engine.client() as c:
        return await c.weight_version(), (await c.weights_checksum(names))["checksums"]


def expected(state: dict[str, torch.Tensor], dtype=torch.bfloat16) -> dict[str, str]:
    return {n: tensor_hash(t, dtype) for n, t in state.items()}


class Publisher:
    """The trainer side as rlx's sender drives it: `senders` transport instances, each sending its share."""

    def __init__(self, engines, output_dir: Path, senders: int = 2, **args):
        self.engines, self.output_dir = engines, output_dir
        args = {"dtype": "bfloat16", **args}
        self.transports = [DeltaTransport(DeltaTransport.Config(**args)) for _ in range(senders)]
        self.ctxs = [TransportContext(engines, output_dir, sender=i, senders=senders) for i in range(senders)]

    async def setup(self):
        for t, c in zip(self.transports, self.ctxs, strict=True):
            await t.setup(c)

    async def send(self, state: dict[str, torch.Tensor], version: int) -> None:
        names = list(state)
        for i, (t, c) in enumerate(zip(self.transports, self.ctxs, strict=True)):
            await t.send(iter([(n, state[n]) for n in names[i::len(self.transports)]]), version, c)

    async def push(self, state, version: int) -> None:
        await self.send(state, version)
        await self.transports[0].commit(version, self.ctxs[0])

    async def close(self):
        for t in self.transports:
            await t.close()

    @property
    def root(self) -> Path:
        return self.transports[0].root


def test_fifty_pushes_are_bit_exact_for_what_a_bf16_engine_serves(bf16_engine, model_path, tmp_path):
    """fp32 masters, a bf16 engine: after every push every tensor the engine serves hashes as the masters
    rounded to bf16 (no drift over 50 steps), deltas are far smaller than full versions, old ones pruned."""
    masters = {k: v.float() for k, v in load_file(f"{model_path}/model.safetensors").items()}
    names = list(masters)
    gen = torch.Generator().manual_seed(0)
    pub = Publisher([bf16_engine], tmp_path, senders=2, full_every=10, keep_full=2)
    sizes: dict[bool, list[float]] = {True: [], False: []}

    async def run():
        await pub.setup()
        for version in range(1, 51):
            for t in masters.values():  # an optimizer step at a small learning rate
                t.add_(torch.randn(t.shape, generator=gen) * 1e-3 * t.abs().mean())
            await pub.push(masters, version)
            full = pub.transports[0].stats["full"] == 1.0
            sizes[full].append(sum(t.stats["published_bytes"] for t in pub.transports))
            v, sums = await served(bf16_engine, names)
            assert v == str(version)
            assert sums == expected(masters), f"version {version} differs from the trainer's"
        # the agent removes its earlier local copy after the engine serves the new one, then reports: wait for its
        # report before stopping it (the commit waits for the engine only)
        [status] = (pub.root / "agents").glob("*.json")
        for _ in range(600):
            if json.loads(status.read_text()).get("version") == 50:
                break
            await asyncio.sleep(0.05)
        await pub.close()

    asyncio.run(run())
    assert len(sizes[True]) == 5 and len(sizes[False]) == 45  # versions 1, 11, 21, 31, 41 are full
    assert max(sizes[False]) < 0.9 * min(sizes[True])
    kept = list(codec.published(pub.root))
    assert kept == list(range(31, 51))  # the two newest full versions and the deltas after them
    agent_dir = next((tmp_path / "delta-agents").iterdir())
    assert [p.name for p in agent_dir.glob("weight_v*")] == ["weight_v000050"]  # one local copy, no .tmp


def test_a_corrupt_byte_is_a_loud_error_and_the_engine_keeps_its_last_good_version(bf16_engine, model_path,
                                                                                    tmp_path):
    state = {k: v.float() for k, v in load_file(f"{model_path}/model.safetensors").items()}
    names = list(state)
    pub = Publisher([bf16_engine], tmp_path, senders=1, timeout_s=60)

    async def run():
        await pub.setup()
        await pub.push(state, 1)
        good = {k: v + 0.01 for k, v in state.items()}
        await pub.push(good, 2)
        bad = {k: v + 0.02 for k, v in good.items()}
        await pub.send(bad, 3)
        tmp = pub.root / (codec.folder_name(3) + ".tmp")
        biggest = max(tmp.glob("*.zst"), key=lambda p: p.stat().st_size)
        data = bytearray(biggest.read_bytes())
        data[len(data) // 2] ^= 0x40
        biggest.write_bytes(bytes(data))
        with pytest.raises(RLXError, match=r"agent of engine .* failed on version 3: DeltaError: version 3: "
                                           r".*(corrupt data|does not match its checksum).*keeps serving version 2"):
            await pub.transports[0].commit(3, pub.ctxs[0])
        v, sums = await served(bf16_engine, names)
        assert v == "2" and sums == expected(good)
        await pub.close()

    asyncio.run(run())
    status = json.loads(next((pub.root / "agents").glob("*.json")).read_text())
    assert status["version"] == 2 and "version 3" in status["error"]


def test_a_deleted_version_is_a_loud_error_until_a_full_version_reseeds(bf16_engine, model_path, tmp_path):
    state = {k: v.float() for k, v in load_file(f"{model_path}/model.safetensors").items()}
    names = list(state)
    pub = Publisher([bf16_engine], tmp_path, senders=1, agents="external", full_every=4)
    versions = {v: {k: t + 0.01 * v for k, t in state.items()} for v in range(1, 6)}

    async def run():
        await pub.setup()
        agent = Agent(pub.root, tmp_path / "local", bf16_engine.url)
        for v in (1, 2):
            await pub.send(versions[v], v)
            pub.transports[0].publish(v, pub.ctxs[0])
            assert await agent.step() == v
        for v in (3, 4):
            await pub.send(versions[v], v)
            pub.transports[0].publish(v, pub.ctxs[0])
        import shutil

        shutil.rmtree(pub.root / codec.folder_name(3))
        with pytest.raises(DeltaError, match="version 3 is missing"):
            await agent.step()
        assert await served(bf16_engine, names) == ("2", expected(versions[2]))
        assert not list((tmp_path / "local").glob("*.tmp"))
        # a fresh host cannot get there either: the chain back to a full version is broken
        with pytest.raises(DeltaError, match="version 3 is missing"):
            await Agent(pub.root, tmp_path / "fresh", bf16_engine.url).step()
        await pub.send(versions[5], 5)  # the 5th push: a full version, which reseeds the host
        pub.transports[0].publish(5, pub.ctxs[0])
        assert codec.read_manifest(pub.root / codec.folder_name(5))["kind"] == "full"
        assert await agent.step() == 5
        assert await served(bf16_engine, names) == ("5", expected(versions[5]))

    asyncio.run(run())


def test_an_agent_killed_mid_apply_leaves_the_engine_on_its_version_and_recovers(bf16_engine, model_path,
                                                                                  tmp_path):
    state = {k: v.float() for k, v in load_file(f"{model_path}/model.safetensors").items()}
    names = list(state)
    pub = Publisher([bf16_engine], tmp_path, senders=1, agents="external")
    local = tmp_path / "local"
    cmd = [*AGENT, "--source", str(tmp_path / "weights-delta"), "--local", str(local), "--engine",
           bf16_engine.url, "--once"]

    async def publish(v, s):
        await pub.send(s, v)
        pub.transports[0].publish(v, pub.ctxs[0])

    asyncio.run(pub.setup())
    asyncio.run(publish(1, state))
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    new = {k: v - 0.03 for k, v in state.items()}
    asyncio.run(publish(2, new))
    killed = subprocess.run(cmd, capture_output=True, timeout=120, env={**os.environ, "RLX_DELTA_AGENT_FAULT": "write"})
    assert killed.returncode == 137
    assert [p.name for p in local.glob("*.tmp")] == ["weight_v000002.tmp"]  # a half-written checkpoint
    assert asyncio.run(served(bf16_engine, names)) == ("1", expected(state))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert not list(local.glob("*.tmp"))
    assert asyncio.run(served(bf16_engine, names)) == ("2", expected(new))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_engine_started_by_hand_with_its_agent_trains_end_to_end(model_path, tmp_path, mode):
    """`rl weights-agent` beside an engine rlx does not own; `rl train` attaches by address and publishes
    deltas to the store (in async mode while the engine keeps generating); after training, the engine
    serves exactly the exported model."""
    from rlx.testing.runs import small_run_config

    engine, proc = start_engine(model_path, tmp_path)
    store = tmp_path / "store"
    agent = ManagedProcess([sys.executable, "-m", "rlx_cli.main", "weights-agent", "--source", str(store),
                            "--local", str(tmp_path / "agent-local"), "--engine", engine.url, "--poll-s", "0.05"],
                           tmp_path / "agent.log")
    agent.start()
    try:
        cfg = small_run_config(tmp_path, "run", rollout={"external_engines": [engine.url]}, ray={"enabled": False},
                               train={"num_steps": 3, "mode": mode},
                               weight_sync={"transport": {"name": "delta", "args": {
                                   "path": str(store), "agents": "external", "full_every": 10}}})
        run = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf",
                              str(tmp_path / "hf")], capture_output=True, text=True, timeout=900,
                             env={**os.environ, "RLX_TEST_TAG": uuid.uuid4().hex})
        assert run.returncode == 0, run.stderr[-3000:] + "\nagent log:\n" + agent.log_tail(40)
        exported = load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
        versions = list(codec.published(store))
        kinds = [codec.read_manifest(store / codec.folder_name(v))["kind"] for v in versions]
        assert "delta" in kinds
        version, sums = asyncio.run(served(engine, list(exported)))
        assert version == str(versions[-1])
        assert sums == {n: tensor_hash(t, torch.float32) for n, t in exported.items()}
        assert agent.alive(), agent.log_tail()
    finally:
        agent.stop()
        proc.stop()


def test_hosts_catch_up_along_chains_follow_a_resumed_run_and_restore_a_restarted_engine(bf16_engine, model_path,
                                                                                         tmp_path):
    state = {k: v.float() for k, v in load_file(f"{model_path}/model.safetensors").items()}
    names = list(state)
    weights = {v: {k: t + 0.01 * v for k, t in state.items()} for v in range(1, 5)}

    async def publish(pub, v, s):
        await pub.send(s, v)
        return pub.transports[0].publish(v, pub.ctxs[0])

    async def run():
        pub = Publisher([bf16_engine], tmp_path, senders=2, agents="external")
        await pub.setup()
        for v in (1, 2, 3, 4):
            await publish(pub, v, weights[v])
        assert [codec.read_manifest(p)["kind"] for p in codec.published(pub.root).values()] == ["full"] + ["delta"] * 3
        # a fresh host: the full version, then three deltas in a row
        agent = Agent(pub.root, tmp_path / "host", bf16_engine.url)
        assert agent.plan() == [1, 2, 3, 4]
        assert await agent.step() == 4
        assert await served(bf16_engine, names) == ("4", expected(weights[4]))

        # the run is resumed from its step-2 checkpoint: a new trainer (empty snapshot) pushes version 3 again,
        # with other weights; the stale versions 3 and 4 go, and the host follows the new run
        resumed = Publisher([bf16_engine], tmp_path, senders=2, agents="external")
        await resumed.setup()
        other = {k: t - 0.05 for k, t in state.items()}
        folder = await publish(resumed, 3, other)
        assert list(codec.published(pub.root)) == [3] and codec.read_manifest(folder)["kind"] == "full"  # 1, 2 pruned
        assert await agent.step() == 3
        assert await served(bf16_engine, names) == ("3", expected(other))
        assert [p.name for p in (tmp_path / "host").glob("weight_v*")] == ["weight_v000003"]

        # the engine restarts (here: reloads its original weights); the agent, restarted too, restores its copy
        async with bf16_engine.client() as c:
            await c.update_weights_from_disk(model_path, weight_version="0")
        restarted = Agent(pub.root, tmp_path / "host", bf16_engine.url)
        assert restarted.version == 3 and await restarted.step() is None
        assert await served(bf16_engine, names) == ("3", expected(other))

    asyncio.run(run())


def test_lora_adapters_travel_as_deltas_in_async_training(tmp_path):
    """``train.lora.push: adapter`` through the delta store, in async mode: each version is the adapter alone, named in
    its manifest as the engines serve it (actor-vN-<hex>), deltas after the first; the local agent loads each as an adapter;
    samples record the adapter and version that made them."""
    from rlx.data.replay import read_batches
    from rlx.testing.runs import small_run_config

    store = tmp_path / "store"
    cfg = small_run_config(tmp_path, "run", ray={"enabled": False}, rollout={"save_batches": True},
                           train={"num_steps": 4, "mode": "async", "lora": {"rank": 4, "alpha": 8},
                                  "optim": {"lr": 1e-2}},
                           weight_sync={"transport": {"name": "delta", "args": {"path": str(store), "full_every": 10,
                                                                                "keep_full": 1}}})
    run = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "RLX_TEST_TAG": uuid.uuid4().hex})
    assert run.returncode == 0, run.stderr[-3000:]
    manifests = {v: codec.read_manifest(store / codec.folder_name(v)) for v in codec.published(store)}
    assert sorted(manifests) == [1, 2, 3, 4]
    assert [m["kind"] for m in manifests.values()] == ["full", "delta", "delta", "delta"]
    for v, m in manifests.items():
        assert m["adapter"]["name"].startswith(f"actor-v{v}-") and m["adapter"]["config"]["r"] == 4
        assert all(".lora_A." in n or ".lora_B." in n for n in m["tensors"])  # the adapter alone
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len({r["weight_sync/bytes"] for r in rows}) == 1 and rows[0]["weight_sync/bytes"] < 100_000
    adapters: dict[str | None, set[int]] = {}
    for groups in read_batches(tmp_path / "run" / "batches").values():
        for s in (s for g in groups for s in g.samples):
            adapters.setdefault(s.adapter, set()).update(s.token_versions)
    assert adapters.pop(None) == {0} and adapters  # the base model first, then adapters
    assert all(versions == {int(name.split("-")[1][1:])} for name, versions in adapters.items())
