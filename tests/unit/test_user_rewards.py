"""Rewards as users write them (a plain function, an ``async def``, a closure made by a factory, a class) score
under both isolations a config offers, through `Rewards` as a run holds them: a sync reward is pickled and
scored in a reward worker process (the default) or in a thread. A lambda without a name is refused at
registration, saying how to give it one."""

import asyncio
import os
import types

import pytest

from rlx import hookimpl
from rlx.config import RewardSpec, RolloutConfig
from rlx.errors import PluginError
from rlx.plugins import build_plugins
from rlx.rollout.rewards import Rewards
from rlx.types import RewardResult, Sample, SampleStatus


def close_answer(sample):
    """1 for the label, 0.5 one off, else 0 (the README's plain-function reward)."""
    try:
        gap = abs(int(sample.response_text.strip()) - int(sample.label))
    except ValueError:
        return 0.0
    return 1.0 if gap == 0 else 0.5 if gap == 1 else 0.0


async def async_answer(sample):
    await asyncio.sleep(0)
    return float(sample.response_text.strip() == sample.label)


def within(tolerance):
    """A factory: the reward it makes is a closure over `tolerance` (pickle cannot name it; cloudpickle sends it
    by value)."""

    def within_tolerance(sample):
        return RewardResult(float(abs(int(sample.response_text) - int(sample.label)) <= tolerance),
                            info={"pid": os.getpid()})

    within_tolerance.name = f"within_{tolerance}"
    return within_tolerance


class LabelLength:
    name = "label_length"

    def score(self, sample):
        return RewardResult(float(len(sample.label)), info={"pid": os.getpid()})


def plugin(*rewards):
    mod = types.SimpleNamespace()

    @hookimpl
    def register_rewards(register):
        for r in rewards:
            register(r)

    mod.register_rewards = register_rewards
    return build_plugins(entry_points=False, extra=[("mine", mod)])


def score(plugins, name: str, isolation: str, response: str, label: str) -> Sample:
    rewards = Rewards([RewardSpec(name=name)], plugins, RolloutConfig(scoring={"isolation": isolation, "workers": 1}))
    return asyncio.run(rewards.score(Sample(prompt_ids=[1], response_ids=[2], response_text=response, label=label)))


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_functions_closures_and_classes_score_where_the_config_says(isolation):
    plugins = plugin(close_answer, async_answer, within(2), LabelLength)
    assert {"async_answer", "close_answer", "label_length", "within_2"} <= set(plugins.names("rewards"))
    for name, response, label, want in [("close_answer", " 41", "42", 0.5), ("close_answer", "x", "42", 0.0),
                                        ("async_answer", "42", "42", 1.0), ("within_2", "40", "42", 1.0),
                                        ("within_2", "39", "42", 0.0), ("label_length", "", "abcd", 4.0)]:
        s = score(plugins, name, isolation, response, label)
        assert s.status != SampleStatus.FAILED, s.error
        assert s.reward == want, (name, response, label)
    pid = score(plugins, "within_2", isolation, "1", "1").rewards["within_2"].info["pid"]
    assert (pid != os.getpid()) == (isolation == "process")  # sync rewards in a worker process by default


def test_a_lambda_needs_a_name():
    with pytest.raises(PluginError, match=r"plugin 'mine' registered a reward that cannot be one: a lambda .* "
                                          r"write it as a def, or set its name first"):
        plugin(lambda sample: 1.0)
    named = lambda sample: 0.25  # noqa: E731
    named.name = "quarter"
    assert score(plugin(named), "quarter", "process", "", "").reward == 0.25


def test_a_function_component_says_what_it_wraps():
    comp = plugin(close_answer).get("rewards", "close_answer")
    assert comp.score is close_answer and comp.__doc__ == close_answer.__doc__
    assert repr(comp) == f"<close_answer: {__name__}.close_answer>"


class HoldsALock:
    name = "holds_a_lock"

    def __init__(self):
        import threading

        self.lock = threading.Lock()  # no pickler sends a lock

    def score(self, sample):
        return 1.0


def test_the_contract_suite_fails_a_reward_a_run_could_not_send_to_its_workers():
    from rlx.errors import RLXError
    from rlx.testing import RewardCase, RewardContract

    mod = types.SimpleNamespace(register_rewards=hookimpl(lambda register: register(HoldsALock)))

    class TestHoldsALock(RewardContract):
        reward_name = "holds_a_lock"
        plugin = mod
        cases = [RewardCase("a", None, 1.0), RewardCase("b", None, 1.0)]

    with pytest.raises(RLXError, match="the reward cannot be sent to a reward worker process"):
        TestHoldsALock().test_cases()
