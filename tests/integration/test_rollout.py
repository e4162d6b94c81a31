"""Rollout end to end on the tiny model: `rl rollout`, partial rollout across steps, a dead engine."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rlx.config import parse_config
from rlx.tasks import arithmetic, write_jsonl
from rlx.errors import RLXError
from rlx.plugins import build_plugins
from rlx.rollout.session import RolloutSession
from rlx.types import SampleStatus

pytestmark = pytest.mark.integration


async def until(cond, what: str, timeout_s: float = 60) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s:g}s: {what}")


def config(tmp_path, **rollout):
    data = write_jsonl(arithmetic(64), tmp_path / "data.jsonl")
    base = {"n_prompts": 4, "n_samples_per_prompt": 2, "rewards": ["exact_match"],
            "sampling": {"max_new_tokens": 8}, "engines": [{"server_args": {"num_threads": 1}}]}
    doc = {"run": {"output_dir": str(tmp_path / "run")}, "model": {"path": "builtin://tiny-qwen3"},
           "data": {"path": str(data)}, "rollout": base | rollout}
    return parse_config(json.dumps(doc))


def test_rl_rollout_writes_scored_groups(tiny_model_path, tmp_path):
    data = write_jsonl(arithmetic(32), tmp_path / "data.jsonl")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(textwrap.dedent(f"""
        run: {{output_dir: {tmp_path / 'run'}}}
        model: {{path: builtin://tiny-qwen3}}
        data: {{path: {data}}}
        rollout:
          n_prompts: 3
          n_samples_per_prompt: 2
          num_steps: 2
          rewards: [exact_match]
          sampling: {{max_new_tokens: 6}}
          engines: [{{server_args: {{num_threads: 1}}}}]
    """))
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "rollout", str(cfg)], capture_output=True,
                       text=True, timeout=300, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    groups = [json.loads(line) for line in (tmp_path / "run" / "rollout.jsonl").read_text().splitlines()]
    assert len(groups) == 6 and [g["step"] for g in groups].count(2) == 3
    for g in groups:
        for s in g["samples"]:
            assert s["status"] in ("completed", "truncated") and s["reward"] in (0.0, 1.0)
            assert 0 < len(s["response_ids"]) <= 6 == 6 and len(s["rollout_logprobs"]) == len(s["response_ids"])
            assert s["rewards"]["exact_match"]["score"] == s["reward"]
    assert len({s["sample_id"] for g in groups for s in g["samples"]}) == 12


def test_partial_rollout_aborts_at_the_boundary_and_resumes_from_the_prefix(tiny_model_path, tmp_path):
    cfg = config(tmp_path, n_prompts=2, partial_rollout={"enabled": True, "over_sampling": 3.0},
                 sampling={"max_new_tokens": 1500}, requests={"max_concurrency": 12})

    async def go():
        async with RolloutSession(cfg, build_plugins()) as s:
            b1 = await s.manager.next_batch(1)
            kept = [g.group_id for g in s.manager.pending]
            pending = {x.sample_id: list(x.response_ids) for g in s.manager.pending for x in g.samples
                       if x.status == SampleStatus.ABORTED}
            # No fresh prompts from here on: the next two steps must finish exactly the kept groups. (With
            # over-sampling, fresh groups race the resumed ones, and which finish first is up to the lengths
            # the random model samples.)
            s.manager.rc.partial_rollout.over_sampling = 1.0
            later = [await s.manager.next_batch(2), await s.manager.next_batch(3)]
            return b1, kept, pending, later, s.manager.pending

    b1, kept, pending, later, left = asyncio.run(go())
    assert len(b1.groups) == 2 and pending, "groups still running at the boundary were kept"
    assert len(kept) == 4 and sorted(g.group_id for b in later for g in b.groups) == sorted(kept) and not left
    resumed = {x.sample_id: x for b in later for x in b.samples if x.sample_id in pending}
    assert resumed.keys() == pending.keys()
    for sid, x in resumed.items():
        prefix = pending[sid]
        assert x.response_ids[: len(prefix)] == prefix and len(x.response_ids) > len(prefix)
        assert len(x.rollout_logprobs) == len(x.response_ids) == len(x.loss_mask)


def test_without_fault_tolerance_killing_the_engine_mid_rollout_is_a_clear_error(tiny_model_path, tmp_path):
    cfg = config(tmp_path, sampling={"max_new_tokens": 1500, "ignore_eos": True}, n_prompts=4,
                 fault_tolerance={"enabled": False})

    async def go():
        async with RolloutSession(cfg, build_plugins()) as s:
            task = asyncio.create_task(s.manager.next_batch(1))
            while s.ctx.gate.in_flight == 0:  # generating: the kill lands mid-rollout
                await asyncio.sleep(0.01)
            os.kill(s.fleet.engines[0].process.pid, signal.SIGKILL)
            await asyncio.wait_for(task, 60)

    with pytest.raises(RLXError, match="unreachable"):
        asyncio.run(go())


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_the_only_engine_killed_or_frozen_mid_rollout_is_restarted_and_the_batch_completes(
        tiny_model_path, tmp_path, how):
    """One engine, no router: killed (SIGKILL) or frozen (SIGSTOP) while every request is in flight. It is
    taken out, restarted at a new address, and the requests are sent again there: every sample finishes."""
    cfg = config(tmp_path, sampling={"max_new_tokens": 200, "ignore_eos": True}, n_prompts=4,
                 fault_tolerance={"probe_interval_s": 0.3, "probe_timeout_s": 1, "failures": 2})

    async def go():
        async with RolloutSession(cfg, build_plugins()) as s:
            first = s.fleet.engines[0]
            pid, url = first.process.pid, first.url
            task = asyncio.create_task(s.manager.next_batch(1))
            # a request per group: its two samples go as one (rollout.requests.coalesce)
            await until(lambda: s.ctx.gate.in_flight == 4, "every group's request in flight")
            os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            batch = await asyncio.wait_for(task, 120)
            return batch, s.fleet.health.metrics(), first.url != url, first.process.pid != pid

    batch, metrics, moved, new_pid = asyncio.run(go())
    assert len(batch.groups) == 4 and all(x.status.trainable for x in batch.samples)
    assert all(len(x.response_ids) == 200 for x in batch.samples)  # no token twice, none lost
    assert metrics["engines/taken_out"] == 1 and metrics["engines/restarts"] == 1
    assert metrics["engines/rejoined"] == 1 and metrics["rollout/resent_requests"] >= 4
    assert moved and new_pid


def test_with_two_engines_a_dead_one_is_retried_on_the_other(tiny_model_path, tmp_path):
    cfg = config(tmp_path, engines=[{"num_engines": 2, "server_args": {"num_threads": 1}}],
                 router={"policy": "round_robin"}, requests={"retries": 2})

    async def go():
        async with RolloutSession(cfg, build_plugins()) as s:
            s.fleet.engines[0].process.stop()
            return await asyncio.wait_for(s.manager.next_batch(1), 120)

    batch = asyncio.run(go())
    assert len(batch.groups) == 4 and all(x.status.trainable for x in batch.samples)


def test_a_frozen_attached_engine_is_taken_out_its_requests_sent_again_and_it_rejoins_when_thawed(
        tiny_model_path, tmp_path):
    """Two engines rlx did not launch (it cannot kill or restart them): one frozen mid-rollout. Its requests,
    which would hang until rollout.requests.timeout_s, are cancelled and sent to the other; the batch completes, and
    the engine rejoins once it answers again."""
    from rlx.rollout.engines.launch import HOST, ManagedProcess, embedded_command, free_port, wait_healthy

    ports = [free_port(), free_port()]
    procs = [ManagedProcess(embedded_command(tiny_model_path, p, server_args={"num_threads": 1}),
                            tmp_path / f"e{p}.log") for p in ports]
    for p in procs:
        p.start()
    try:
        urls = [f"http://{HOST}:{p}" for p in ports]
        cfg = config(tmp_path, sampling={"max_new_tokens": 200, "ignore_eos": True}, n_prompts=4, engines=[],
                     external_engines=urls, router={"policy": "round_robin"}, requests={"timeout_s": 300},
                     fault_tolerance={"probe_interval_s": 0.3, "probe_timeout_s": 1, "failures": 2})

        async def go():
            await asyncio.gather(*(wait_healthy(u, p, 60) for u, p in zip(urls, procs)))
            async with RolloutSession(cfg, build_plugins()) as s:
                task = asyncio.create_task(s.manager.next_batch(1))
                await until(lambda: s.ctx.gate.in_flight == 4, "every group's request in flight")
                os.kill(procs[0].pid, signal.SIGSTOP)
                batch = await asyncio.wait_for(task, 120)
                out = dict(s.fleet.health.metrics())
                os.kill(procs[0].pid, signal.SIGCONT)
                for _ in range(100):
                    if s.fleet.health.counts["engines/rejoined"]:
                        break
                    await asyncio.sleep(0.1)
                return batch, out, s.fleet.health.metrics()

        batch, during, after = asyncio.run(go())
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT) if p.alive() else None
            p.stop()
    assert len(batch.groups) == 4 and all(len(x.response_ids) == 200 for x in batch.samples)
    assert during["engines/taken_out"] == 1 and during["engines/serving"] == 1 and during["engines/restarts"] == 0
    assert during["rollout/resent_requests"] >= 1
    assert after["engines/rejoined"] == 1 and after["engines/serving"] == 2
