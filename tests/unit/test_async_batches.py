"""Async batches without engines: admission keeps lags within max_staleness, stale groups are regenerated,
dropped or masked, swaps pause or drain, and a checkpoint loses and repeats no group."""

import asyncio
import json
import types

import pytest

from rlx import hookimpl
from rlx.config import parse_config
from rlx.data.datasets import PromptDataset
from rlx.plugins import build_plugins
from rlx.rollout.batches import AsyncBatches, SyncBatches, batch_source
from rlx.rollout.context import GenerateContext
from rlx.rollout.manager import RolloutManager
from rlx.types import Group, Sample, SampleStatus


class FakeEngine:
    """The engine's weight version, an abort switch, and a log of control calls."""

    def __init__(self):
        self.version = 0
        self.abort_event = asyncio.Event()
        self.calls: list[str] = []
        self.busy = 0
        self.peak_ahead = 0

    async def for_each(self, fn):
        return [await fn(self)]

    async def pause(self, mode="abort"):
        self.calls.append(f"pause:{mode}")

    async def resume(self):
        self.calls.append("resume")

    async def abort_all(self):
        self.abort_event.set()
        await asyncio.sleep(0)
        self.abort_event.clear()


ENGINE: FakeEngine | None = None


class Tok:
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1, 2, 3]


class Versioned:
    """Two tokens a sample, tagged with the engine's version; an abort cuts it after the first."""

    name = "versioned"

    async def generate(self, ctx, sample):
        async with ctx.gate:
            ENGINE.busy += 1
            try:
                if not sample.response_ids:
                    sample.response_ids, sample.token_versions = [7], [ENGINE.version]
                    sample.loss_mask, sample.rollout_logprobs = [1], [-1.0]
                abort = asyncio.ensure_future(ENGINE.abort_event.wait())
                done, _ = await asyncio.wait({abort}, timeout=0.002 * (1 + sample.sample_id % 4))
                abort.cancel()
                if done:
                    sample.status = SampleStatus.ABORTED
                    return [sample]
                sample.response_ids.append(8)
                sample.token_versions.append(ENGINE.version)
                sample.loss_mask.append(1)
                sample.rollout_logprobs.append(-1.0)
                sample.status = SampleStatus.COMPLETED
                sample.reward = float(sample.index)
                return [sample]
            finally:
                ENGINE.busy -= 1


def setup(tmp_path, **train):
    global ENGINE
    ENGINE = FakeEngine()
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "label": i}) + "\n" for i in range(50)))
    cfg = parse_config(json.dumps({
        "model": {"path": "/m"}, "data": {"path": str(data), "shuffle": False},
        "rollout": {"generator": "versioned", "n_prompts": 3, "n_samples_per_prompt": 2},
        "train": {"mode": "async", "async": train}}))
    mod = types.ModuleType("gen")
    mod.register_generators = hookimpl(lambda register: register(Versioned))
    plugins = build_plugins(entry_points=False, extra=[("gen", mod)])
    ctx = GenerateContext(client=None, tokenizer=Tok(), sampling=cfg.rollout.sampling)
    manager = RolloutManager(cfg, plugins, PromptDataset(cfg.data, data), ctx, abort_all=ENGINE.abort_all)
    return cfg, manager, batch_source(cfg, manager, ENGINE)


async def train_steps(batches, steps, start_version=0, slow=0.01):
    """Take batches like the loop does, moving the engine's version after each 'train step'."""
    version, out = start_version, []
    for step in range(1, steps + 1):
        batch = await batches.next_batch(step, version)
        out.append(batch)
        await asyncio.sleep(slow)  # training, while the stream generates
        version += 1
        await batches.swap(lambda v=version: setattr(ENGINE, "version", v) or asyncio.sleep(0))
    return out, version


def test_the_mode_picks_the_source(tmp_path):
    cfg, manager, batches = setup(tmp_path)
    assert isinstance(batches, AsyncBatches) and batches.capacity == 3
    cfg2 = cfg.model_copy(deep=True)
    cfg2.train.mode = "sync"
    assert isinstance(batch_source(cfg2, manager, ENGINE), SyncBatches)


@pytest.mark.parametrize("staleness", [1, 3])
def test_admission_keeps_every_group_within_the_staleness_bound(tmp_path, staleness):
    cfg, manager, batches = setup(tmp_path, max_staleness=staleness)

    async def go():
        batches.start()
        out, _ = await train_steps(batches, 6)
        await batches.close()
        return out

    out = asyncio.run(go())
    assert all(b.metrics["async/staleness_max"] <= staleness for b in out)
    assert sum(b.metrics["async/stale_groups"] for b in out) == 0
    assert any(b.metrics["async/staleness_max"] >= 1 for b in out)  # it did generate ahead
    ids = [s.sample_id for b in out for g in b.groups for s in g.samples]
    assert len(ids) == len(set(ids)) == 6 * 3 * 2


async def one_batch(batches, version):
    batches.start()
    batch = await batches.next_batch(1, version)
    await batches.close()
    return batch


def old_group(gid, versions):
    samples = [Sample([1], [7] * len(v), [1] * len(v), [-1.0] * len(v), status=SampleStatus.COMPLETED,
                      reward=float(i), group_id=gid, sample_id=100 + 10 * gid + i, index=i, token_versions=list(v))
               for i, v in enumerate(versions)]
    return Group(gid, samples, prompt_index=gid)


@pytest.mark.parametrize("policy", ["regenerate", "drop"])
def test_a_group_past_the_bound_is_regenerated_or_dropped(tmp_path, policy):
    cfg, manager, batches = setup(tmp_path, max_staleness=1, stale_groups=policy)
    batches.queued = [old_group(90, [[0, 0], [0, 5]]), old_group(91, [[4], [5]]), old_group(92, [[5], [4]]),
                      old_group(93, [[5], [5]])]

    batch = asyncio.run(one_batch(batches, version=5))
    assert [g.group_id for g in batch.groups] == [91, 92, 93] and batch.metrics["async/stale_groups"] == 1
    regenerated = [g for g in manager.pending if g.group_id == 90]
    if policy == "regenerate":  # back first in line, with its ids and no tokens
        assert manager.pending[0].group_id == 90
        assert [(s.sample_id, s.status, s.response_ids) for s in regenerated[0].samples] == [
            (1000, SampleStatus.PENDING, []), (1001, SampleStatus.PENDING, [])]
    else:
        assert regenerated == []


def test_mask_stale_tokens_masks_only_tokens_past_the_bound(tmp_path):
    cfg, manager, batches = setup(tmp_path, max_staleness=1, mask_stale_tokens=True)
    batches.queued = [old_group(90, [[0, 5], [4, 4]]), old_group(91, [[0], [2]]), old_group(92, [[5], [5]]),
                      old_group(93, [[5], [5]])]

    batch = asyncio.run(one_batch(batches, version=5))
    g90 = batch.groups[0]
    assert g90.group_id == 90 and [s.loss_mask for s in g90.samples] == [[0, 1], [1, 1]]
    assert [g.group_id for g in batch.groups] == [90, 92, 93]  # 91 had nothing left: regenerated
    assert batch.metrics["async/masked_tokens"] == 3 and batch.metrics["async/stale_groups"] == 1


def test_swaps_pause_generation_or_drain_requests(tmp_path):
    cfg, manager, batches = setup(tmp_path, swap="pause")
    seen = []
    asyncio.run(batches.swap(lambda: asyncio.sleep(0, seen.append(list(ENGINE.calls)))))
    assert seen == [["pause:retract"]] and ENGINE.calls == ["pause:retract", "resume"]

    cfg, manager, batches = setup(tmp_path, swap="drain")

    async def go():
        batches.start()
        for _ in range(1000):
            if ENGINE.busy:
                break
            await asyncio.sleep(0.001)
        assert ENGINE.busy
        busy_at_push = []
        await batches.swap(lambda: asyncio.sleep(0, busy_at_push.append(ENGINE.busy)))
        await batches.close()
        return busy_at_push

    assert asyncio.run(go()) == [0] and ENGINE.calls == []


def test_a_checkpoint_keeps_queued_and_in_flight_groups_and_loses_none(tmp_path):
    cfg, manager, batches = setup(tmp_path, max_staleness=2)

    async def first_run():
        batches.start()
        before, version = await train_steps(batches, 2)
        await asyncio.sleep(0.003)  # some groups half done, some queued
        state = json.loads(json.dumps(await batches.state_dict()))
        await batches.close()
        return before, version, state

    before, version, state = asyncio.run(first_run())
    partial = [s for g in state["pending"] for s in g["samples"] if s["status"] == "aborted"]
    assert state["queued"] or partial
    assert all(len(s["response_ids"]) == 1 for s in partial)  # kept with the token they had

    cfg, manager2, batches2 = setup(tmp_path, max_staleness=2)
    batches2.load_state_dict(state)

    async def resumed():
        batches2.start()
        after, _ = await train_steps(batches2, 4, start_version=version)
        await batches2.close()
        return after

    after = asyncio.run(resumed())
    trained = [g.group_id for b in before + after for g in b.groups]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    saved = [g["group_id"] for g in state["queued"] + state["pending"]]
    assert set(saved) <= {g.group_id for b in after for g in b.groups}, "a saved group was lost"
    left = {g.group_id for g in manager2.pending} | {g.group_id for g in batches2.queued}
    assert set(trained) | left == set(range(manager2.next_group_id))


def test_sync_batches_release_engine_memory_around_train_steps_when_asked(tmp_path):
    cfg, manager, _ = setup(tmp_path)
    cfg.train.mode = "sync"
    calls = []

    class Fleet:
        def __init__(self):
            self.serving = [types.SimpleNamespace(state="serving")]

        async def for_each(self, fn, engines=None):
            client = types.SimpleNamespace(release_memory=lambda: asyncio.sleep(0, calls.append("release")),
                                           resume_memory=lambda: asyncio.sleep(0, calls.append("resume")),
                                           pause=lambda mode: asyncio.sleep(0, calls.append(f"pause:{mode}")),
                                           resume=lambda: asyncio.sleep(0, calls.append("continue")))
            return [await fn(client) for _ in (self.serving if engines is None else engines)]

    assert not batch_source(cfg, manager, Fleet()).offload  # CPU, disaggregated: off by default
    cfg.rollout.offload_during_train = True
    batches = batch_source(cfg, manager, Fleet())

    async def go():
        await batches.before_train()
        calls.append("train")
        await batches.after_train()

    asyncio.run(go())
    # SGLang releases memory only on an idle server: generation is paused (aborting what runs) first
    assert calls == ["pause:abort", "release", "train", "resume", "continue"]

    # an engine taken out and restarted during the train step holds its memory, unpaused: it is not resumed
    calls.clear()

    async def restarted_meanwhile():
        await batches.before_train()
        batches.fleet.serving[0].state = "down"
        batches.fleet.serving.append(types.SimpleNamespace(state="serving"))
        await batches.after_train()

    asyncio.run(restarted_meanwhile())
    assert calls == ["pause:abort", "release"]
