"""rlx reward plugin ``math``: extract the final answer and check it with math-verify.

Extraction: the last ``\\boxed{...}`` (braces balanced), else the last number in the text. The answer
and the label are both parsed by math-verify and compared symbolically. math-verify's own timeouts use
SIGALRM, which only works in the main thread; rewards run in worker threads, so they are turned off
here and the rollout manager's per-sample timeout bounds the time instead.
"""

from __future__ import annotations

import logging
import re

from pydantic import BaseModel, ConfigDict

from rlx import hookimpl
from rlx.hookspecs import RegisterRewards
from rlx.types import RewardResult, Sample

# math-verify warns on every call that its own timeouts are off; that is this plugin's choice.
for _name in ("math_verify", "math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).setLevel(logging.ERROR)

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}``, with nested braces; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: the response was cut off inside the box


def extract_answer(text: str, boxed_only: bool = False) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None or boxed_only:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def equivalent(answer: str, label: str) -> bool:
    from math_verify import parse, verify

    def _parse(s: str):
        return parse(f"\\boxed{{{s}}}", parsing_timeout=None) or parse(s, parsing_timeout=None)

    gold, pred = _parse(label), _parse(answer)
    if not gold or not pred:
        return answer.strip() == label.strip()
    return bool(verify(gold, pred, timeout_seconds=None))


class MathReward:
    """1.0 if the response's final answer equals the label mathematically, else `format_score` or 0."""

    name = "math"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        boxed_only: bool = False  # only a \boxed{} answer counts
        format_score: float = 0.0  # score for a wrong answer that is at least present

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    def score(self, sample: Sample) -> RewardResult:
        answer = extract_answer(sample.response_text, self.config.boxed_only)
        if answer is None or sample.label is None:
            return RewardResult(0.0, {"correct": 0.0, "has_answer": 0.0}, {"answer": answer})
        correct = equivalent(answer, str(sample.label))
        score = 1.0 if correct else self.config.format_score
        return RewardResult(score, {"correct": float(correct), "has_answer": 1.0}, {"answer": answer})


@hookimpl
def register_rewards(register: RegisterRewards) -> None:
    register(MathReward)
