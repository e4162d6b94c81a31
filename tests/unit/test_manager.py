"""The rollout manager with in-process generators and rewards (no engine): filtering, over-sampling,
failing rewards, partial groups and exact state round trips."""

import asyncio
import json
import os
import random
import signal
import threading
import time
import types
from pathlib import Path

import pytest
from pydantic import BaseModel
from rlx import hookimpl
from rlx.config import parse_config
from rlx.data.datasets import PromptDataset
from rlx.errors import RLXError
from rlx.plugins import build_plugins
from rlx.rollout.context import GenerateContext
from rlx.rollout import rewards
from rlx.rollout.manager import RolloutManager
from rlx.types import RewardResult, SampleStatus


class ByteTok:
    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1] + self.encode(messages[-1]["content"]) + [2]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode(errors="replace")


class EchoLabel:
    """Answers the label for even sample indices, garbage otherwise; prompt 'same' always answers 'x'."""

    name = "echo"

    async def generate(self, ctx, sample):
        await asyncio.sleep(0.001 * (sample.sample_id % 5))
        text = "x" if sample.prompt_text == "same" else (str(sample.label) if sample.index % 2 == 0 else "?")
        sample.response_ids = list(text.encode())
        sample.loss_mask = [1] * len(text)
        sample.rollout_logprobs = [-1.0] * len(text)
        sample.response_text = text
        sample.status = SampleStatus.COMPLETED
        return [sample]


class Jittery(EchoLabel):
    """EchoLabel, finishing in an order `JITTER` draws: a run of the manager under other timing."""

    name = "jittery"

    async def generate(self, ctx, sample):
        await asyncio.sleep(JITTER.random() * 0.01)
        return await super().generate(ctx, sample)


JITTER = random.Random(0)


class SamplingEcho(EchoLabel):
    """Answers with the sampling its context holds: temperature and max_new_tokens."""

    name = "sampling_echo"

    async def generate(self, ctx, sample):
        out = await super().generate(ctx, sample)
        out[0].response_text = f"{ctx.sampling.temperature}/{ctx.sampling_params()['max_new_tokens']}"
        return out


class Boom:
    name = "boom"

    def score(self, sample):
        if sample.index == 1:
            raise ValueError("bad row")
        return 1.0


class Slow:
    name = "slow"

    async def score(self, sample):
        await asyncio.sleep(5)
        return 1.0


class NotANumber:
    name = "nan"

    def score(self, sample):
        return [float("nan"), float("inf"), 1.0][sample.index % 3]


HUNG = threading.Event()
HUNG_CALLS: list[int] = []  # one entry per Hung.score call begun


class Hung:
    """A sync reward that never returns (until the test lets it go)."""

    name = "hung"

    def score(self, sample):
        HUNG_CALLS.append(sample.sample_id)
        HUNG.wait(60)
        return 1.0


class HangsOnOne:
    """Hangs (for an hour) on sample index 3, after writing its pid to `pid_file`; 1.0 for the others."""

    name = "hangs_on_one"

    class Config(BaseModel):
        pid_file: str

    def __init__(self, config):
        self.config = config

    def score(self, sample):
        if sample.index == 3:
            Path(self.config.pid_file).write_text(str(os.getpid()))
            time.sleep(3600)
        return 1.0


class Crashes:
    """Takes its worker process down: exit code 3 on index 1, SIGSEGV on index 2; 1.0 for the others."""

    name = "crashes"

    def score(self, sample):
        if sample.index == 1:
            os._exit(3)
        if sample.index == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        return 1.0


class Timed:
    """Sleeps 0.3 s, prints to stdout (the worker's frames have pipes of their own), and says where and when
    it ran."""

    name = "timed"

    def score(self, sample):
        t0 = time.monotonic()
        print(f"scoring sample {sample.sample_id}", flush=True)
        time.sleep(0.3)
        return RewardResult(1.0, info={"pid": os.getpid(), "t0": t0, "t1": time.monotonic()})


class Unpicklable:
    name = "unpicklable"

    def __init__(self):
        self.lock = threading.Lock()

    def score(self, sample):
        with self.lock:
            return 1.0


def plugins():
    mod = types.ModuleType("test-gen")
    mod.register_generators = hookimpl(lambda register: [register(c) for c in (EchoLabel, Jittery, SamplingEcho)])
    mod.register_rewards = hookimpl(lambda register: [register(c) for c in (
        Boom, Slow, NotANumber, Hung, HangsOnOne, Crashes, Timed, Unpicklable)])
    return build_plugins(entry_points=False, extra=[("test-gen", mod)])


def make(tmp_path, rows, **rollout):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config(json.dumps({"model": {"path": "/m"}, "data": {"path": str(data), "shuffle": False},
                                   "rollout": {"generator": "echo", **rollout}}))
    p = plugins()
    ds = PromptDataset(cfg.data, data)
    return RolloutManager(cfg, p, ds, GenerateContext(client=None, tokenizer=ByteTok(), sampling=cfg.rollout.sampling))


ROWS = [{"prompt": f"q{i}", "label": str(i)} for i in range(6)]


def test_batch_has_n_groups_of_n_samples_with_unique_ids_and_rewards(tmp_path):
    m = make(tmp_path, ROWS, n_prompts=3, n_samples_per_prompt=4, rewards=["exact_match"])
    batch = asyncio.run(m.next_batch(1))
    assert len(batch.groups) == 3 and all(len(g.samples) == 4 for g in batch.groups)
    ids = [s.sample_id for s in batch.samples]
    assert len(set(ids)) == 12
    assert [s.reward for s in batch.groups[0].samples] == [1.0, 0.0, 1.0, 0.0]
    assert batch.metrics["reward/mean"] == 0.5 and batch.metrics["reward/exact_match/mean"] == 0.5
    assert batch.groups[0].samples[0].prompt_ids == [1, *b"q0", 2]


def test_zero_variance_groups_are_dropped_and_replaced(tmp_path):
    rows = [{"prompt": "same", "label": "x"}, *ROWS]
    m = make(tmp_path, rows, n_prompts=3, n_samples_per_prompt=2, rewards=["exact_match"],
             dynamic_sampling={"filter_zero_variance": True})
    batch = asyncio.run(m.next_batch(1))
    assert len(batch.groups) == 3 and batch.metrics["rollout/groups_filtered"] == 1
    assert all(g.prompt_index != 0 for g in batch.groups)


def test_under_run_deterministic_the_batch_and_what_is_left_over_do_not_depend_on_which_group_finished_first(
        tmp_path):
    """Over-sampling 6 groups for 3 and filtering the zero-variance ones: each round of groups finishes whole and is
    taken in id order, so that under three timings the batches, and the groups left over for the next step, are the
    same groups with the same samples."""
    rows = [{"prompt": "same", "label": "x"}, *ROWS[:2], {"prompt": "same", "label": "x"}, *ROWS[2:]]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config(json.dumps({
        "run": {"deterministic": True}, "model": {"path": "/m"}, "data": {"path": str(data), "shuffle": False},
        "rollout": {"generator": "jittery", "n_prompts": 3, "n_samples_per_prompt": 2, "rewards": ["exact_match"],
                    "dynamic_sampling": {"filter_zero_variance": True},
                    "partial_rollout": {"enabled": True, "over_sampling": 2.0}}}))

    def run(timing):
        JITTER.seed(timing)
        m = RolloutManager(cfg, plugins(), PromptDataset(cfg.data, data),
                           GenerateContext(client=None, tokenizer=ByteTok(), sampling=cfg.rollout.sampling))
        steps = [asyncio.run(m.next_batch(step)) for step in (1, 2)]
        return ([[(g.group_id, [(s.sample_id, s.response_text, s.reward) for s in g.samples]) for g in b.groups]
                 for b in steps], [g.group_id for g in m.pending])

    first = run(1)
    assert [[gid for gid, _ in b] for b in first[0]][0] == [1, 2, 4]  # 0 and 3 ask "same": filtered
    assert run(2) == first and run(3) == first


def test_a_rows_sampling_overrides_reach_the_generator_for_its_samples_only(tmp_path):
    rows = [{"prompt": "q0", "label": "0", "m": {"sampling": {"temperature": 0.25, "max_new_tokens": 7}, "tool": "x"}},
            {"prompt": "q1", "label": "1"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config(json.dumps({"model": {"path": "/m"}, "data": {"path": str(data), "shuffle": False,
                                                                     "metadata_key": "m"},
                                   "rollout": {"generator": "sampling_echo", "n_prompts": 2, "n_samples_per_prompt": 2,
                                               "sampling": {"temperature": 0.9, "max_new_tokens": 5}}}))
    m = RolloutManager(cfg, plugins(), PromptDataset(cfg.data, data),
                       GenerateContext(client=None, tokenizer=ByteTok(), sampling=cfg.rollout.sampling))
    batch = asyncio.run(m.next_batch(1))
    assert [[s.response_text for s in g.samples] for g in batch.groups] == [["0.25/7"] * 2, ["0.9/5"] * 2]
    assert batch.groups[0].samples[0].metadata["tool"] == "x"  # the rest of the row's metadata reaches it as is


def test_all_filtered_is_a_clear_error(tmp_path):
    m = make(tmp_path, [{"prompt": "same", "label": "x"}], n_prompts=2, n_samples_per_prompt=2,
             rewards=["exact_match"], dynamic_sampling={"filter_zero_variance": True, "max_rounds": 2})
    with pytest.raises(RLXError, match="every group was filtered out"):
        asyncio.run(m.next_batch(1))


def test_a_raising_reward_fails_its_sample_not_the_run(tmp_path):
    m = make(tmp_path, ROWS, n_prompts=2, n_samples_per_prompt=3, rewards=["boom"])
    batch = asyncio.run(m.next_batch(1))
    failed = [s for s in batch.samples if s.status == SampleStatus.FAILED]
    assert len(failed) == 2 and all("reward 'boom' raised ValueError: bad row" == s.error for s in failed)
    assert batch.metrics["rollout/failed"] == 2


def test_a_nan_or_inf_reward_fails_its_sample_with_the_value_and_the_step_says_why(tmp_path, capsys):
    m = make(tmp_path, ROWS, n_prompts=2, n_samples_per_prompt=3, rewards=["nan"])
    batch = asyncio.run(m.next_batch(4))
    errors = sorted(s.error for s in batch.samples if s.status == SampleStatus.FAILED)
    assert errors == ["reward 'nan' returned inf (not a finite number)"] * 2 + \
        ["reward 'nan' returned nan (not a finite number)"] * 2
    assert all(s.reward == 1.0 for s in batch.samples if s.status.trainable)
    err = capsys.readouterr().err
    assert "rlx: warning: step 4: 4 of 6 samples failed; 2 with: reward 'nan' returned" in err
    assert "(1 other reason(s))" in err


def test_hung_sync_rewards_in_threads_time_out_without_taking_the_threads_trainer_calls_use(tmp_path, monkeypatch):
    """scoring.isolation: thread, more hung rewards than the default thread pool has threads: they time out in
    their own pool, and a trainer-style ``asyncio.to_thread`` call still runs at once."""

    monkeypatch.setattr(rewards, "_THREADS", {})
    m = make(tmp_path, ROWS, n_prompts=4, n_samples_per_prompt=4, rewards=["hung"], dynamic_sampling={"max_rounds": 1},
             scoring={"timeout_s": 0.2, "isolation": "thread", "workers": 2})

    async def go():
        HUNG_CALLS.clear()
        task = asyncio.create_task(m.next_batch(1))
        async def both_threads_taken():  # by hung rewards (the others wait for a thread)
            while len(HUNG_CALLS) < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(both_threads_taken(), 30)
        other = await asyncio.wait_for(asyncio.to_thread(lambda: "trainer call"), 2)
        with pytest.raises(RLXError, match="16 samples failed, e.g. reward 'hung' timed out after 0.2s"):
            await task
        return other

    try:
        assert asyncio.run(go()) == "trainer call"  # asyncio.run returns: no thread of its waits on a hung reward
    finally:
        HUNG.set()


def test_a_reward_hung_on_one_sample_in_eight_is_killed_at_its_time_out_and_the_others_score(tmp_path):
    pid_file = tmp_path / "hung.pid"
    m = make(tmp_path, ROWS[:2], n_prompts=2, n_samples_per_prompt=4, scoring={"timeout_s": 1}, dynamic_sampling={"max_rounds": 1},
             rewards=[{"name": "hangs_on_one", "args": {"pid_file": str(pid_file)}}])
    batch = asyncio.run(m.next_batch(1))
    failed = [s for s in batch.samples if s.status == SampleStatus.FAILED]
    assert [(s.index, s.error) for s in failed] == \
        [(3, "reward 'hangs_on_one' timed out after 1s (its worker process was killed)")] * 2
    assert sorted(s.reward for s in batch.samples if s.status.trainable) == [1.0] * 6
    assert not Path(f"/proc/{pid_file.read_text()}").exists()  # killed and reaped, not left sleeping


def test_a_reward_that_crashes_its_worker_fails_only_its_sample_and_a_fresh_worker_goes_on(tmp_path):
    m = make(tmp_path, ROWS[:3], n_prompts=3, n_samples_per_prompt=4, rewards=["crashes"], dynamic_sampling={"max_rounds": 1})
    batch = asyncio.run(m.next_batch(1))
    errors = sorted((s.index, s.error) for s in batch.samples if s.status == SampleStatus.FAILED)
    assert errors == [(1, "reward 'crashes' crashed its worker process (exit code 3)")] * 3 + \
        [(2, "reward 'crashes' crashed its worker process (killed by SIGSEGV)")] * 3
    assert [s.reward for s in batch.samples if s.status.trainable] == [1.0] * 6


def test_scoring_workers_bounds_how_many_sync_rewards_run_at_once(tmp_path, capfd):
    # The pools are shared by the process's rollouts: one that an earlier test started holds the stdout it
    # was started with, not capfd's. Close them, so that this test's workers print where capfd reads.
    rewards._close_pools()
    m = make(tmp_path, ROWS[:3], n_prompts=3, n_samples_per_prompt=2, rewards=["timed"], scoring={"workers": 2},
             dynamic_sampling={"max_rounds": 1})
    batch = asyncio.run(m.next_batch(1))
    infos = [s.rewards["timed"].info for s in batch.samples]
    assert len(infos) == 6 and len({i["pid"] for i in infos}) <= 2 and os.getpid() not in {i["pid"] for i in infos}
    busiest = max(sum(i["t0"] <= j["t0"] < i["t1"] for i in infos) for j in infos)
    assert busiest == 2
    assert capfd.readouterr().out.count("scoring sample") == 6


def test_a_reward_that_cannot_be_pickled_is_named_at_start_and_runs_in_threads_when_asked(tmp_path):
    with pytest.raises(RLXError, match=r"rollout.rewards\[0\] \(unpicklable\): the reward cannot be sent to a "
                                       r"reward worker process \(TypeError: cannot pickle '_thread.lock'.*"
                                       r"rollout.scoring.isolation: thread"):
        make(tmp_path, ROWS, n_prompts=1, rewards=["unpicklable"])
    m = make(tmp_path, ROWS, n_prompts=1, n_samples_per_prompt=2, rewards=["unpicklable"], scoring={"isolation": "thread"})
    assert [s.reward for s in asyncio.run(m.next_batch(1)).samples] == [1.0, 1.0]


def test_a_slow_reward_times_out_per_sample(tmp_path):
    m = make(tmp_path, ROWS[:1], n_prompts=1, n_samples_per_prompt=2, rewards=["slow"], scoring={"timeout_s": 0.05},
             dynamic_sampling={"max_rounds": 1})
    with pytest.raises(RLXError, match=r"2 samples failed, e.g. reward 'slow' timed out after 0.05s"):
        asyncio.run(m.next_batch(1))


def test_state_round_trip_continues_with_the_same_prompts_and_ids(tmp_path):
    m = make(tmp_path, ROWS, n_prompts=2, n_samples_per_prompt=2, rewards=["exact_match"])
    asyncio.run(m.next_batch(1))
    state = json.loads(json.dumps(m.state_dict()))
    want = asyncio.run(m.next_batch(2))
    m2 = make(tmp_path, ROWS, n_prompts=2, n_samples_per_prompt=2, rewards=["exact_match"])
    m2.load_state_dict(state)
    got = asyncio.run(m2.next_batch(2))
    assert [(s.sample_id, s.prompt_ids) for s in got.samples] == [(s.sample_id, s.prompt_ids) for s in want.samples]


def test_plugin_group_filter_and_rollout_end_hook(tmp_path):
    """The filter drops groups in the manager. ``on_rollout_end`` is called once per batch by the training step
    (`one_step`), after the batch source (sync, async or the rollout buffer) returns it and before training."""
    from types import SimpleNamespace

    from rlx.orchestrate.loop import one_step

    events = []
    mod = types.ModuleType("flt")
    mod.filter_group = hookimpl(lambda group: group.prompt_index != 1)
    mod.on_rollout_end = hookimpl(lambda batch: events.append(("rollout_end", batch.step)))
    m = make(tmp_path, ROWS, n_prompts=2, n_samples_per_prompt=2, rewards=["exact_match"])
    m.plugins = build_plugins(entry_points=False, extra=[("gen", plugins().pm.get_plugin("test-gen")), ("flt", mod)])
    batch = asyncio.run(m.next_batch(7))
    assert [g.prompt_index for g in batch.groups] == [0, 2] and events == []  # not the source's call

    class Source:  # the sync source, without engines
        async def next_batch(self, step, version):
            return await m.next_batch(step)

        async def before_train(self):
            pass

        async def after_train(self):
            pass

        async def swap(self, push):
            await push()

    class Weights:
        trainer = SimpleNamespace(cpu_seconds=lambda: [])
        fleet = SimpleNamespace(serving=[])

        async def train_step(self, batch):
            events.append(("train", batch.step))
            return {}

        async def push(self, version):
            events.append(("push", version))
            return 0  # the bytes sent

        def metrics(self):
            return {}

    cfg = parse_config(json.dumps({"model": {"path": "/m"}, "data": {"path": "/d"}}))
    batch, record = asyncio.run(one_step(cfg, m.plugins, Source(), Weights(), 8, 3))
    assert events == [("rollout_end", 8), ("train", 8), ("push", 4)]
    assert record["step"] == 8 and record["weight_version"] == 4 and batch.step == 8


def test_stream_mode_fills_a_bounded_queue_and_keeps_unfinished_groups(tmp_path):
    m = make(tmp_path, ROWS, n_prompts=2, n_samples_per_prompt=2, rewards=["exact_match"])

    async def go():
        queue = asyncio.Queue(maxsize=3)
        stop = asyncio.Event()
        task = asyncio.create_task(m.run_stream(queue, stop))
        got = [await queue.get() for _ in range(5)]
        while not queue.full():  # filled up again, so that a put is blocked at stop
            await asyncio.sleep(0.001)
        stop.set()
        await asyncio.wait_for(task, 5)
        while not queue.empty():
            got.append(queue.get_nowait())
        return got

    got = asyncio.run(go())
    delivered = [g.group_id for g in got]
    kept_back = [g.group_id for g in m.pending]
    assert len(delivered) >= 5 and all(len(g.samples) == 2 and all(s.reward is not None for s in g.samples)
                                       for g in got)
    # Nothing lost, nothing twice: every group made was delivered or kept for later.
    assert sorted(delivered + kept_back) == list(range(m.next_group_id))


def test_a_trajectory_is_scored_once_on_the_branch_with_its_answer(tmp_path):
    from rlx.types import Sample

    m = make(tmp_path, ROWS, rewards=["exact_match"])

    def branch(sid, text, final=False):
        s = Sample([1], list(text.encode()), [1] * len(text), [-1.0] * len(text), response_text=text, label="7",
                   status=SampleStatus.COMPLETED, sample_id=sid, trajectory_id=9)
        if final:
            s.metadata["final"] = True
        return s

    # a subagent branch that says something else, and the main chain holding the answer
    out = [branch(0, "7", final=True), branch(1, "thinking")]
    asyncio.run(m._score_trajectory(out))
    assert [s.reward for s in out] == [1.0, 1.0]  # the answer's reward, not each branch's own (1 and 0)
    # without a mark the last branch holds the answer
    out = [branch(2, "7"), branch(3, "nope")]
    asyncio.run(m._score_trajectory(out))
    assert [s.reward for s in out] == [0.0, 0.0]


def test_a_regenerated_group_keeps_dataset_metadata_only(tmp_path):
    from rlx.types import Group, Sample

    m = make(tmp_path, ROWS)
    s = Sample([1], [2], [1], [-1.0], sample_id=4, group_id=0, metadata={"task": "t", "final": True,
                                                                        "sampled_tokens": 1, "agent_turns": 2})
    m.regenerate(Group(0, [s]))
    assert m.pending[0].samples[0].metadata == {"task": "t"}


def test_too_long_prompts_are_skipped_and_counted_or_stop_the_run_naming_the_line(tmp_path, capsys):
    rows = [{"prompt": "q" * 40, "label": "0"}] + ROWS  # line 1: 42 tokens with the template's two
    m = make(tmp_path, rows, n_prompts=6, n_samples_per_prompt=1, rewards=["exact_match"])
    m.cfg.data.max_prompt_tokens = 10
    batch = asyncio.run(m.next_batch(1))
    assert sorted(s.prompt_text for s in batch.samples) == [f"q{i}" for i in range(6)]
    assert batch.metrics["rollout/long_prompts_skipped"] == 1.0
    assert "d.jsonl:1: the prompt has 42 tokens, over data.max_prompt_tokens (10): skipped" in capsys.readouterr().err

    m = make(tmp_path, rows, n_prompts=2, n_samples_per_prompt=1, rewards=["exact_match"])
    m.ctx.context_length = 42  # the engines' context: a 42-token prompt leaves no room
    m.cfg.data.on_long_prompt = "error"
    with pytest.raises(RLXError, match=r"d.jsonl:1: the prompt has 42 tokens, and the engines' context is 42"):
        asyncio.run(m.next_batch(1))

    m = make(tmp_path, rows[:1], n_prompts=1, n_samples_per_prompt=1, rewards=["exact_match"])
    m.cfg.data.max_prompt_tokens = 10
    with pytest.raises(RLXError, match="every prompt is longer than 10 tokens"):
        asyncio.run(m.next_batch(1))
