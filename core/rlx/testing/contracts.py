"""Contract test suites that plugin tests subclass (pytest collects the ``test_*`` methods)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar

from rlx.plugins import build_plugins
from rlx.rollout.rewards import call_reward, instantiate
from rlx.types import RewardResult, Sample

ODD_RESPONSES = [
    "",
    " ",
    "\\boxed{",
    "}}}{{{",
    "∑∫√ 🙂 \x00 \ufffd",
    "9" * 5000,
    "answer: " + "x" * 20000,
    "NaN inf -inf 1e309",
]


@dataclass
class RewardCase:
    """A response, its label, and the score the reward must give."""

    response: str
    label: Any
    score: float


class RewardContract:
    """The reward contract. Set `reward_name` and `cases`; optionally `args`, `plugin`, `score_range`.

    `plugin`: the plugin module to register for the test; None means "as installed", through the
    entry points, which also checks that the distribution's entry point works.
    """

    reward_name: ClassVar[str]
    cases: ClassVar[list[RewardCase]] = []
    args: ClassVar[dict[str, Any]] = {}
    plugin: ClassVar[object | None] = None
    score_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def _plugins(self):
        extra = [(f"contract-{self.reward_name}", self.plugin)] if self.plugin is not None else []
        return build_plugins(entry_points=self.plugin is None, extra=extra)

    def _reward(self) -> Any:
        return instantiate(self._plugins().get("rewards", self.reward_name), self.args)

    def _score(self, reward: Any, response: str, label: Any) -> RewardResult:
        sample = Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], response_text=response, label=label)
        return asyncio.run(call_reward(reward, sample, self.reward_name))

    def test_registered_under_its_name(self):
        assert self.reward_name in self._plugins().names("rewards")

    def test_config_has_defaults(self):
        instantiate(self._plugins().get("rewards", self.reward_name), {})

    def test_has_cases(self):
        assert len(self.cases) >= 2, "give at least one case scoring high and one scoring low"
        assert len({c.score for c in self.cases}) >= 2, "cases must not all expect the same score"

    def test_cases(self):
        reward = self._reward()
        for case in self.cases:
            got = self._score(reward, case.response, case.label).score
            assert got == case.score, f"{case.response!r} vs label {case.label!r}: {got} != {case.score}"

    def test_odd_input_never_raises_and_stays_in_range(self):
        reward = self._reward()
        lo, hi = self.score_range
        labels = [c.label for c in self.cases[:1]] + [None, ""]
        for response in ODD_RESPONSES:
            for label in labels:
                got = self._score(reward, response, label).score
                assert lo <= got <= hi, f"{response[:40]!r}/{label!r}: {got} outside {self.score_range}"

    def test_deterministic(self):
        reward = self._reward()
        for case in self.cases:
            assert self._score(reward, case.response, case.label) == self._score(
                reward, case.response, case.label
            )
