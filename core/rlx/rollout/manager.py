"""The rollout manager: prompts in, scored and filtered groups out, for sync and async training alike.

Choices:

* A group is n samples of one prompt; each sample is one generator call, all of them concurrent under
  ``rollout.requests.max_concurrency``. A group is finished when all its samples are.
* Rewards run after generation (sync or async, each with ``rollout.scoring.timeout_s``); a reward that raises
  or times out marks its sample FAILED with the reason and the run goes on. An engine error is not
  swallowed: it ends the step with a clear `EngineError` (after ``rollout.requests.retries`` retries).
* Group filters (``rollout.dynamic_sampling``): ``filter_zero_variance`` and every plugin's ``filter_group``.
  Dropped groups are replaced by fresh prompts until the batch is full, at most
  ``max_rounds`` × ``n_prompts`` prompts per step.
* Partial rollout: with ``rollout.partial_rollout`` the manager starts ``over_sampling`` × ``n_prompts``
  groups; once the batch is full it aborts what is still running and keeps those samples, with the
  tokens they already have, to resume first in the next step.
* `next_batch` returns one step's batch (sync); `run_stream` keeps a bounded queue of finished groups
  filled (async, see `rlx.rollout.batches`). Both use the same group runner.
* `state_dict` holds the dataset cursor, id counters and unfinished groups, so resume is exact.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlx.config import Config
from rlx.data.datasets import MixedDataset, PromptDataset, PromptRow, tokenize_prompt
from rlx.errors import RLXError
from rlx.rollout.context import GenerateContext, for_sample
from rlx.rollout.engines.client import EngineError
from rlx.rollout.rewards import Rewards
from rlx.types import Group, RolloutBatch, Sample, SampleStatus

if TYPE_CHECKING:
    from rlx.plugins import Plugins
    from rlx.rollout.teachers import Teachers

log = logging.getLogger(__name__)

#: Metadata a generation writes (not the dataset's): dropped when a group is generated again.
GENERATED_METADATA = ("final", "sampled_tokens", "stale_masked_tokens", "agent_turns", "tito_mismatches")


class RolloutManager:
    def __init__(self, cfg: Config, plugins: Plugins, dataset: PromptDataset | MixedDataset, ctx: GenerateContext,
                 abort_all: Callable[[], Any] | None = None, teachers: Teachers | None = None):
        """`abort_all`: an async callable that aborts every in-flight request on every engine. `teachers`: those
        of on-policy distillation, which score each finished sample (`rlx.rollout.teachers`)."""
        self.cfg = cfg
        self.rc = cfg.rollout
        self.plugins = plugins
        self.dataset = dataset
        self.ctx = ctx
        self.abort_all = abort_all
        self.teachers = teachers
        self.generator = plugins.build("generators", self.rc.generator)
        self.rewards = Rewards(self.rc.rewards, plugins, self.rc)
        # multi-LoRA: each adapter's own rewards, where it lists them (its samples' `Sample.lora`)
        adapters = cfg.train.lora.adapters if cfg.train.lora is not None else []
        self.adapter_rewards = {a.name: Rewards(a.rewards, plugins, self.rc, f"train.lora.adapters[{i}].rewards")
                                for i, a in enumerate(adapters) if a.rewards is not None}
        self.sem = asyncio.Semaphore(self.rc.requests.max_concurrency)
        self.next_group_id = 0
        self.next_sample_id = 0
        self.pending: list[Group] = []  # partial groups to resume first
        self.stream_filtered = 0  # groups run_stream's filters dropped (async metrics)
        self.long_prompts = 0  # prompts skipped as too long (data.on_long_prompt: skip)
        self._prompt_cache: dict[int, list[int]] = {}

    # -- building groups -------------------------------------------------------------------------

    def _prompt_ids(self, row: PromptRow) -> list[int]:
        if row.index not in self._prompt_cache:
            try:
                self._prompt_cache[row.index] = tokenize_prompt(self.ctx.tokenizer, row,
                                                                self.cfg.data.apply_chat_template)
            except Exception as e:
                raise RLXError(f"{row.where}: could not apply the chat template: {e}") from e
        return self._prompt_cache[row.index]

    def _prompt_limit(self) -> int | None:
        limit = self.cfg.data.max_prompt_tokens
        ctx = self.ctx.context_length
        if ctx is not None:  # a prompt that fills the context leaves no room for one token (SGLang: 400)
            limit = min(limit, ctx - 1) if limit is not None else ctx - 1
        return limit

    def _next_prompt(self) -> tuple[PromptRow, list[int]]:
        """The next dataset row whose prompt fits ``data.max_prompt_tokens`` and the context (too long ones are
        skipped and counted, or stop the run, ``data.on_long_prompt``)."""
        limit = self._prompt_limit()
        for _ in range(len(self.dataset) + 1):
            row = self.dataset.next()
            ids = self._prompt_ids(row)
            if limit is None or len(ids) <= limit:
                return row, ids
            where = f"{row.where}: the prompt has {len(ids)} tokens"
            why = (f"over data.max_prompt_tokens ({self.cfg.data.max_prompt_tokens})"
                   if self.cfg.data.max_prompt_tokens is not None and len(ids) > self.cfg.data.max_prompt_tokens
                   else f"and the engines' context is {self.ctx.context_length} tokens")
            if self.cfg.data.on_long_prompt == "error":
                raise RLXError(f"{where}, {why} (data.on_long_prompt: skip drops such prompts)")
            if not self.long_prompts:
                print(f"rlx: warning: {where}, {why}: skipped, as are later ones (counted in "
                      f"rollout/long_prompts_skipped)", file=sys.stderr, flush=True)
            self.long_prompts += 1
        raise RLXError(f"{self.dataset.path}: every prompt is longer than {limit} tokens "
                       f"(data.max_prompt_tokens, the engines' context length)")

    def new_group(self) -> Group:
        row, ids = self._next_prompt()
        gid = self.next_group_id
        self.next_group_id += 1
        samples = []
        for i in range(self.rc.n_samples_per_prompt):
            samples.append(Sample(prompt_ids=list(ids), prompt_text=row.prompt or "", label=row.label,
                                  group_id=gid, sample_id=self.next_sample_id, index=i,
                                  metadata=dict(row.metadata), lora=row.lora))
            self.next_sample_id += 1
        return Group(gid, samples, prompt_index=row.index)

    # -- running a group -------------------------------------------------------------------------

    async def _run_sample(self, sample: Sample) -> list[Sample]:
        async with self.sem:
            try:
                out = await self.generator.generate(for_sample(self.ctx, sample), sample)
            except EngineError:
                raise
            except Exception as e:
                sample.status = SampleStatus.FAILED
                sample.error = f"generator {self.rc.generator.name!r} raised {type(e).__name__}: {e}"
                return [sample]
        if not isinstance(out, list) or not all(isinstance(s, Sample) for s in out):
            raise RLXError(f"generator {self.rc.generator.name!r} must return a list of Sample, got {type(out).__name__}")
        seen: set[int] = set()
        for s in out:  # branches (subagents, compaction): fresh ids, one trajectory, the sample's adapter
            s.lora = sample.lora
            if s.sample_id < 0 or s.sample_id in seen:
                s.sample_id, self.next_sample_id = self.next_sample_id, self.next_sample_id + 1
            seen.add(s.sample_id)
            if len(out) > 1 and s.trajectory_id is None:
                s.trajectory_id = sample.sample_id
        await self._score_trajectory(out)
        if self.teachers:
            await self.teachers.score(out)
        return out

    async def _score_trajectory(self, out: list[Sample]) -> None:
        """One reward per trajectory: a plain sample is scored on its own; an agent's branches take the
        reward of the branch holding its answer (marked ``final``, else the last one), unless the
        generator set rewards itself."""
        todo = [s for s in out if s.status.trainable and s.reward is None]
        if not todo:
            return
        rewards = self.adapter_rewards.get(out[0].lora, self.rewards)  # type: ignore[arg-type]
        if len(out) == 1:
            await rewards.score(todo[0])
            return
        final = next((s for s in reversed(out) if s.metadata.get("final")), out[-1])
        if final.status.trainable and final.reward is None:
            await rewards.score(final)
        for s in todo:
            if s is final:
                continue
            if final.reward is None:  # the answer failed to score: so does the trajectory
                s.status, s.error = SampleStatus.FAILED, f"its trajectory's answer failed to score: {final.error}"
            else:
                s.reward, s.rewards = final.reward, dict(final.rewards)

    async def run_group(self, group: Group) -> Group:
        """Generate (or resume) every unfinished sample of the group, then score it."""
        todo = [s for s in group.samples if s.status in (SampleStatus.PENDING, SampleStatus.ABORTED)]
        done = [s for s in group.samples if s not in todo]
        results = await asyncio.gather(*(self._run_sample(s) for s in todo))
        group.samples = sorted(done + [s for r in results for s in r], key=lambda s: (s.index, s.sample_id))
        return group

    def keep(self, group: Group) -> bool:
        """Apply the group filters; marks a dropped group's samples FILTERED."""
        trainable = group.trainable
        keep = bool(trainable)
        if keep and self.rc.dynamic_sampling.filter_zero_variance:
            keep = len({s.reward for s in trainable}) > 1
        if keep:
            keep = self.plugins.keep_group(group)
        if not keep:
            for s in group.samples:
                if s.status.trainable:
                    s.status = SampleStatus.FILTERED
        return keep

    # -- one step (sync) -------------------------------------------------------------------------

    async def next_batch(self, step: int, weight_version: int = 0) -> RolloutBatch:
        t0 = time.monotonic()
        target = self.rc.n_prompts
        budget = self.rc.dynamic_sampling.max_rounds * target  # fresh prompts this step may use
        partial = self.rc.partial_rollout
        start = target if not partial.enabled else int(round(partial.over_sampling * target))
        kept: list[Group] = []
        dropped = 0
        errors: list[str] = []
        running: dict[asyncio.Task, Group] = {}

        def launch(g: Group) -> None:
            running[asyncio.create_task(self.run_group(g))] = g

        def refill() -> None:  # new groups for those dropped
            nonlocal budget
            while len(kept) + len(running) < target and budget > 0:
                launch(self.new_group())
                budget -= 1

        while self.pending and len(running) < max(start, len(self.pending)):
            launch(self.pending.pop(0))
        while len(running) < start and budget > 0:
            launch(self.new_group())
            budget -= 1
        # run.deterministic: which groups make the batch must not depend on which finished first, so each round of
        # groups finishes whole and is taken in id order (a group cut short would carry timing into the next step)
        rounds = self.cfg.run.deterministic
        try:
            while running and len(kept) < target:
                finished, _ = await asyncio.wait(
                    running, return_when=asyncio.ALL_COMPLETED if rounds else asyncio.FIRST_COMPLETED)
                for task in sorted(finished, key=lambda t: running[t].group_id):
                    running.pop(task)
                    group = task.result()
                    if len(kept) < target and self.keep(group):
                        kept.append(group)
                    elif len(kept) < target:
                        dropped += 1
                        errors += [s.error for s in group.samples if s.error]
                    else:
                        self.pending.append(group)  # finished after the batch filled: next step's
                    if not rounds:
                        refill()
                refill()
            if running:
                await self._cut(running)
        except BaseException:
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise
        if len(kept) < target:
            log.warning("step %d: only %d of %d groups kept after filtering %d", step, len(kept), target, dropped)
        if not kept:
            why = (f"{len(errors)} samples failed, e.g. {errors[0]}" if errors
                   else "loosen the filters or raise rollout.dynamic_sampling.max_rounds")
            raise RLXError(f"rollout step {step}: every group was filtered out ({dropped} dropped); {why}")
        kept.sort(key=lambda g: g.group_id)  # training order must not depend on which group finished first
        batch = RolloutBatch(step, kept, weight_version)
        batch.metrics.update(self.batch_metrics(batch, dropped, time.monotonic() - t0))
        return batch

    async def _cut(self, running: dict[asyncio.Task, Group]) -> None:
        """The batch is full: abort what still runs (partial rollout) or wait for it to finish."""
        if self.rc.partial_rollout.enabled and self.abort_all is not None:
            await self.abort_all()
        groups = await asyncio.gather(*running)
        self.pending.extend(groups)

    def batch_metrics(self, batch: RolloutBatch, dropped: int, seconds: float) -> dict[str, float]:
        """Reward, length, status and timing metrics of a batch (sync and async alike)."""
        samples = batch.samples
        m = {**batch.sample_metrics(), "rollout/groups_filtered": float(dropped),
             "rollout/pending_groups": float(len(self.pending)),
             "rollout/long_prompts_skipped": float(self.long_prompts), "time/rollout_s": seconds,
             # the step's response tokens (an agent's tool outputs too), over its rollout time
             "time/rollout_tokens_per_s": sum(len(s.response_ids) for s in samples) / seconds if seconds > 0 else 0.0}
        failed = [s.error for s in samples if s.status == SampleStatus.FAILED and s.error]
        if failed:  # a count alone hides why: say the most common reason
            reasons = Counter(failed)
            top, n = reasons.most_common(1)[0]
            others = f" ({len(reasons) - 1} other reason(s))" if len(reasons) > 1 else ""
            print(f"rlx: warning: step {batch.step}: {len(failed)} of {len(samples)} samples failed; {n} with: "
                  f"{top}{others}", file=sys.stderr, flush=True)
        return m

    # -- streaming (async) -----------------------------------------------------------------------

    async def run_stream(self, queue: asyncio.Queue, stop: asyncio.Event, in_flight: int | None = None,
                         room: asyncio.Event | None = None) -> None:
        """Keep `queue` filled with kept groups until `stop` is set.

        At most `in_flight` groups run at once; given `room`, which the consumer sets when it takes a
        group, queued groups count too (admission control for async training's staleness bound).
        On stop, what still runs is aborted and kept in `pending` with the tokens it has (partial rollout).
        """
        running: set[asyncio.Task] = set()
        in_flight = in_flight or self.rc.n_prompts
        count_queued = room is not None
        room = room or asyncio.Event()
        try:
            while not stop.is_set():
                while len(running) + (queue.qsize() if count_queued else 0) < in_flight and not stop.is_set():
                    g = self.pending.pop(0) if self.pending else self.new_group()
                    running.add(asyncio.create_task(self.run_group(g)))
                room.clear()
                wake = {asyncio.ensure_future(room.wait()), asyncio.ensure_future(stop.wait())}
                finished, _ = await asyncio.wait(running | wake, return_when=asyncio.FIRST_COMPLETED)
                for w in wake:
                    w.cancel()
                for task in running & finished:
                    running.discard(task)
                    group = task.result()
                    if not self.keep(group):
                        self.stream_filtered += 1
                    elif not await self._put_unless_stopped(queue, group, stop):
                        self.pending.append(group)
        finally:
            if running:
                if self.abort_all is not None:
                    await self.abort_all()
                results = await asyncio.gather(*running, return_exceptions=True)
                self.pending.extend(g for g in results if isinstance(g, Group))

    @staticmethod
    async def _put_unless_stopped(queue: asyncio.Queue, group: Group, stop: asyncio.Event) -> bool:
        """Wait for room in the queue, but not past `stop`; False if the group was not queued."""
        put = asyncio.ensure_future(queue.put(group))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({put, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if put.done():
            return True
        put.cancel()
        return False

    def regenerate(self, group: Group) -> None:
        """Run `group` again from its prompt, first in line: the same group and sample ids, no tokens."""
        fresh: dict[int, Sample] = {}
        for s in group.samples:  # one sample per index: a branching generator's extra outputs go
            metadata = {k: v for k, v in s.metadata.items() if k not in GENERATED_METADATA}
            fresh.setdefault(s.index, Sample(prompt_ids=s.prompt_ids, prompt_text=s.prompt_text, label=s.label,
                                             group_id=s.group_id, sample_id=s.sample_id, index=s.index,
                                             metadata=metadata, lora=s.lora))
        group.samples = [fresh[i] for i in sorted(fresh)]
        self.pending.insert(0, group)

    # -- checkpoint ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset.state_dict(),
            "next_group_id": self.next_group_id,
            "next_sample_id": self.next_sample_id,
            "pending": [g.to_dict() for g in self.pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])
        self.next_group_id = state["next_group_id"]
        self.next_sample_id = state["next_sample_id"]
        self.pending = [Group.from_dict(g) for g in state["pending"]]
