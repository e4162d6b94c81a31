import rlx_reward_math
from rlx_reward_math import equivalent, extract_answer, last_boxed

from rlx.testing import RewardCase, RewardContract


class TestMathContractAsInstalled(RewardContract):
    """Through the installed entry point: proves the distribution is wired up."""

    reward_name = "math"
    cases = [
        RewardCase("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        RewardCase("first 3, then finally 42", "42", 1.0),
        RewardCase("\\boxed{41}", "42", 0.0),
        RewardCase("no answer here", "42", 0.0),
    ]


class TestMathContractWithFormatScore(RewardContract):
    reward_name = "math"
    plugin = rlx_reward_math
    args = {"format_score": 0.1, "boxed_only": True}
    cases = [
        RewardCase("\\boxed{7}", "7", 1.0),
        RewardCase("\\boxed{8}", "7", 0.1),
        RewardCase("7", "7", 0.0),  # boxed_only: a bare number is no answer
    ]


def test_last_boxed_handles_nesting_and_takes_the_last():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("\\fbox{x}") == "x"
    assert last_boxed("cut off \\boxed{\\frac{1}{2") is None
    assert last_boxed("nothing") is None


def test_extract_answer_falls_back_to_the_last_number():
    assert extract_answer("we get 1,234 apples and -3.5") == "-3.5"
    assert extract_answer("total 1,234") == "1234"
    assert extract_answer("ratio 3/4") == "3/4"
    assert extract_answer("none") is None
    assert extract_answer("7", boxed_only=True) is None


def test_equivalence_is_symbolic():
    assert equivalent("1/2", "0.5")
    assert equivalent("\\frac{2}{4}", "\\frac{1}{2}")
    assert equivalent("\\{1,2\\}", "\\{2,1\\}")
    assert not equivalent("3", "4")


def test_parts_and_info_say_what_was_extracted():
    from rlx.types import Sample

    r = rlx_reward_math.MathReward().score(Sample([1], response_text="x=\\boxed{5}", label="6"))
    assert r.score == 0.0 and r.parts == {"correct": 0.0, "has_answer": 1.0} and r.info["answer"] == "5"
