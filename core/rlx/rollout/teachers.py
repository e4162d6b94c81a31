"""On-policy distillation's teachers (``rollout.teachers``): each another model, served by engines of its own, that
scores the student's samples token by token; the objective then takes the reverse KL to it
(``train.objective.distill``, `rlx.train.step.distill_advantages` and `rlx.train.objective`).

Choices:

* A teacher is an `EngineFleet` of its own, built from its group as the run's engines are (launched where the run
  places engines, or attached by address; a router when it has several engines; fault tolerance as theirs), so that
  it never takes generation requests, pauses or weights, and its engines may serve another architecture.
* It scores through SGLang's API as SGLang serves it: one request per sample that generates nothing and asks for the
  prompt log-probs from the first response token (``logprob_start_len``), and for the top-k estimator the top
  log-probs there (``top_logprobs_num``). The teacher's forward sees the whole sample, tool outputs included; the KL
  counts the model's tokens only (the loss mask).
* Samples are scored once finished and rewarded, before their group is kept, in sync and async mode alike.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlx.config import Config, EngineGroupConfig, TeacherConfig
from rlx.errors import EngineError, RLXError
from rlx.rollout.engines.fleet import EngineFleet
from rlx.types import Sample, TeacherScore


def teacher_config(cfg: Config, t: TeacherConfig) -> Config:
    """The run's config as a teacher's fleet reads it: its one group of engines (or the URLs it attaches to), and
    nothing the student's engines are launched for (quantised weights, routing records, a fixed router port)."""
    group = EngineGroupConfig(**{k: getattr(t, k) for k in EngineGroupConfig.model_fields})
    rollout = cfg.rollout.model_copy(update={
        "engines": [group], "external_engines": list(t.urls), "quantization": None, "routed_experts": False,
        "teachers": [], "teacher_field": None, "router": cfg.rollout.router.model_copy(update={"port": None})})
    train = cfg.train.model_copy(update={"objective": cfg.train.objective.model_copy(update={"routing_replay": False})})
    return cfg.model_copy(update={"rollout": rollout, "train": train})


class Teachers:
    """The run's teachers, started and stopped with its engines; `score` gives samples their teacher's scores."""

    def __init__(self, cfg: Config, spawn: Any = None, engine_args: Callable[[str], dict[str, Any]] | None = None,
                 engines_here: int | None = None):
        """`spawn`, `engine_args`, `engines_here`: as the run's `EngineFleet` takes them."""
        self.cfg = cfg
        distill = cfg.train.objective.distill
        self.field = cfg.rollout.teacher_field
        self.top_k = distill.top_k if distill is not None and distill.estimator == "top_k" else 0
        self.retries = cfg.rollout.requests.retries
        logs = Path(cfg.run.output_dir) / "logs"
        self.fleets = {t.name: EngineFleet(teacher_config(cfg, t), logs / f"teacher-{t.name}", spawn, engine_args,
                                           engines_here) for t in cfg.rollout.teachers}
        self.context: dict[str, int | None] = {}  # each teacher's context length (its engines' least)

    def __bool__(self) -> bool:
        return bool(self.fleets)

    async def start(self) -> None:
        """Start (or attach to) every teacher's engines; then a teacher whose checkpoint has another tokenizer than
        the student's is refused (preflight compares the folders it finds; this, the models rlx built or
        fetched)."""
        try:
            for name, fleet in self.fleets.items():
                await fleet.start()
                self.context[name] = await fleet.context_length()
            self._same_tokenizers()
        except BaseException:
            await self.stop()
            raise

    def _same_tokenizers(self) -> None:
        from rlx.models.load import vocab_differs
        from rlx.models.tiny import resolve_model_path

        student = Path(resolve_model_path(self.cfg.model.tokenizer or self.cfg.model.path))
        for i, t in enumerate(self.cfg.rollout.teachers):
            folder = Path(resolve_model_path(t.model_path)) if t.model_path else None
            differ = vocab_differs(student, folder) if folder is not None and folder.is_dir() else 0
            if differ:
                raise RLXError(f"rollout.teachers[{i}].model_path: teacher {t.name!r} ({folder}) has another "
                               f"tokenizer than the student ({student}; {differ} vocabulary entries differ): it would "
                               f"score other words than the student wrote. Distil from a teacher of the student's "
                               f"family")

    async def stop(self) -> None:
        for fleet in self.fleets.values():
            await fleet.stop()

    def teacher_of(self, sample: Sample) -> str | None:
        """The teacher of a sample: the one teacher, or the one its row names (``rollout.teacher_field``; None:
        the row names none, and is not distilled)."""
        if self.field is None:
            return next(iter(self.fleets))
        name = sample.metadata.get(self.field)
        if name is not None and name not in self.fleets:
            raise RLXError(f"a row's metadata {self.field!r} is {name!r}, which is no teacher of rollout.teachers "
                           f"({sorted(self.fleets)}); prompt: {sample.prompt_text[:80]!r}")
        return name

    async def score(self, samples: list[Sample]) -> None:
        """Each finished sample with a response gets its teacher's scores (`Sample.teacher`)."""
        await asyncio.gather(*(self._score(s) for s in samples if s.status.trainable and s.response_ids))

    async def _score(self, s: Sample) -> None:
        name = self.teacher_of(s)
        if name is None:
            return
        fleet = self.fleets[name]
        context = self.context.get(name)
        if context is not None and s.total_len > context:
            raise RLXError(f"teacher {name!r}: a sample of {s.total_len} tokens is longer than the teacher's context "
                           f"({context}); serve the teacher with a longer one, or lower rollout.sampling."
                           f"max_new_tokens or data.max_prompt_tokens")
        for attempt in itertools.count():
            try:
                lps, tops = await fleet.client().score(s.prompt_ids + s.response_ids, len(s.prompt_ids), self.top_k,
                                                       retries=self.retries)
                break
            except EngineError as e:  # sent again once an engine serves, as generate requests are
                health = fleet.health
                if health is None or attempt >= health.cfg.max_resends or (e.status is not None and e.status < 500):
                    raise EngineError(f"teacher {name!r}: {e}", e.status) from None
                await health.settle()
                await health.wait_serving()
        s.teacher = TeacherScore(name, lps, [[i for _, i in row] for row in tops], [[lp for lp, _ in row] for row in tops])
