"""Built-in rewards that need nothing beyond the core: exact match against the dataset label, and a
dense digit-fraction reward that a randomly initialised policy can climb (used by the quickstart)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from rlx import hookimpl
from rlx.hookspecs import RegisterRewards
from rlx.types import RewardResult, Sample


class ExactMatch:
    """1.0 when the response equals the label (after optional stripping and case folding), else 0.0."""

    name = "exact_match"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        strip: bool = True  # ignore leading and trailing whitespace
        case_sensitive: bool = True

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    def score(self, sample: Sample) -> RewardResult:
        got, want = sample.response_text, "" if sample.label is None else str(sample.label)
        if self.config.strip:
            got, want = got.strip(), want.strip()
        if not self.config.case_sensitive:
            got, want = got.casefold(), want.casefold()
        return RewardResult(score=float(got == want))


class DigitFraction:
    """Fraction of the response's non-space characters that are digits (0 for an empty response).

    Dense partial credit: every sample gets a different score, so group-relative advantages are
    informative even for a model that has never produced a right answer.
    """

    name = "digits"

    def score(self, sample: Sample) -> RewardResult:
        chars = [c for c in sample.response_text if not c.isspace()]
        if not chars:
            return RewardResult(0.0)
        return RewardResult(sum(c.isdigit() for c in chars) / len(chars))


@hookimpl
def register_rewards(register: RegisterRewards) -> None:
    register(ExactMatch)
    register(DigitFraction)
