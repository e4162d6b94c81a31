import re
import types

import pytest

from rlx import hookimpl
from rlx.errors import PluginError, RLXError
from rlx.plugins import build_plugins, validate_plugin
from rlx.types import Group, RolloutBatch, Sample


def _plugin(name: str, **hooks) -> types.ModuleType:
    mod = types.ModuleType(name)
    for k, fn in hooks.items():
        setattr(mod, k, hookimpl(fn))
    return mod


class Reward:
    name = "double"

    def score(self, sample):
        return 2.0


def test_builtins_are_ordinary_plugins_and_register_components():
    p = build_plugins(entry_points=False)
    assert "exact_match" in p.names("rewards")
    info = next(i for i in p.infos if i.name == "rlx.builtins.rewards")
    assert info.distribution == "rlx" and info.registers == {"rewards": ["exact_match", "digits"]}


def test_extra_plugin_registers_and_is_found_by_name():
    mod = _plugin("mine", register_rewards=lambda register: register(Reward))
    p = build_plugins(entry_points=False, extra=[("mine", mod)])
    assert p.get("rewards", "double") is Reward
    assert p.component("rewards", "double").plugin == "mine"


def test_unknown_component_suggests_the_close_name():
    p = build_plugins(entry_points=False)
    with pytest.raises(RLXError, match=r"no reward named 'exact_mach' \(did you mean 'exact_match'\?\)"):
        p.get("rewards", "exact_mach")


def test_duplicate_component_names_name_both_plugins():
    a = _plugin("alpha", register_rewards=lambda register: register(Reward))
    b = _plugin("beta", register_rewards=lambda register: register(Reward))
    with pytest.raises(PluginError) as e:
        build_plugins(entry_points=False, extra=[("alpha", a), ("beta", b)])
    assert "'alpha'" in str(e.value) and "'beta'" in str(e.value) and "'double'" in str(e.value)


def test_misspelled_hook_name_names_plugin_and_hook():
    bad = _plugin("typo-plugin", register_reward=lambda register: None)
    with pytest.raises(PluginError) as e:
        build_plugins(entry_points=False, extra=[("typo-plugin", bad)])
    msg = str(e.value)
    assert "'typo-plugin'" in msg and "'register_reward'" in msg and "did you mean 'register_rewards'" in msg


def test_misspelled_argument_names_plugin_hook_and_argument():
    bad = _plugin("argy", register_rewards=lambda registr: None)
    with pytest.raises(PluginError) as e:
        build_plugins(entry_points=False, extra=[("argy", bad)])
    msg = str(e.value)
    assert "'argy'" in msg and "'register_rewards'" in msg and "'registr'" in msg and "'register'" in msg


def test_validate_plugin_accepts_subset_of_arguments():
    import pluggy

    from rlx import hookspecs

    pm = pluggy.PluginManager("rlx")
    pm.add_hookspecs(hookspecs)
    validate_plugin(pm, _plugin("ok", on_train_step_end=lambda step: None), "ok")


def test_component_without_name_is_rejected():
    mod = _plugin("nameless", register_rewards=lambda register: register(object()))
    with pytest.raises(PluginError, match="'nameless'.*without a string `name`"):
        build_plugins(entry_points=False, extra=[("nameless", mod)])


def test_exception_in_register_hook_names_the_plugin():
    def boom(register):
        raise KeyError("x")

    with pytest.raises(PluginError, match="plugin 'boom' raised in register_rewards"):
        build_plugins(entry_points=False, extra=[("boom", _plugin("boom", register_rewards=boom))])


def test_disable_plugins_env_skips_builtins(monkeypatch):
    monkeypatch.setenv("RLX_DISABLE_PLUGINS", "rlx.builtins.rewards")
    assert "exact_match" not in build_plugins(entry_points=False).names("rewards")


def test_load_plugins_env_limits_entry_points(monkeypatch):
    monkeypatch.setenv("RLX_LOAD_PLUGINS", "")
    p = build_plugins()
    assert all(i.distribution == "rlx" for i in p.infos)


def test_each_build_is_fresh():
    mod = _plugin("once", register_rewards=lambda register: register(Reward))
    build_plugins(entry_points=False, extra=[("once", mod)])
    assert "double" not in build_plugins(entry_points=False).names("rewards")


def test_lifecycle_hooks_through_the_facade():
    seen = {}

    def filter_group(group):
        return len(set(group.rewards)) > 1

    def on_train_step_end(step, metrics):
        metrics["seen"] = step

    def on_rollout_end(batch):
        seen["groups"] = len(batch.groups)

    mod = _plugin("life", filter_group=filter_group, on_train_step_end=on_train_step_end,
                  on_rollout_end=on_rollout_end)
    p = build_plugins(entry_points=False, extra=[("life", mod)])
    same = Group(0, [Sample([1], reward=1.0), Sample([1], reward=1.0)])
    mixed = Group(1, [Sample([1], reward=0.0), Sample([1], reward=1.0)])
    assert p.keep_group(mixed) and not p.keep_group(same)
    m = {}
    p.on_train_step_end(3, m)
    assert m == {"seen": 3}
    p.on_rollout_end(RolloutBatch(1, [same, mixed]))
    assert seen == {"groups": 2}


def test_every_hookspec_is_exercised_by_a_test():
    # datasette-style guard: a new hook must come with a test that names it.
    import pathlib

    from rlx import hookspecs
    from rlx.plugins import _spec_names

    import inspect

    text = "".join(p.read_text() for p in pathlib.Path(__file__).parent.parent.rglob("test_*.py"))
    text = text.replace(inspect.getsource(test_every_hookspec_is_exercised_by_a_test), "")  # not by naming itself
    missing = [n for n in _spec_names() if n not in text]
    assert not missing, f"hooks without a test: {missing}"
    assert set(_spec_names()) >= {f"register_{k}" for k in hookspecs.KINDS}


def conforming(kind, name=None):
    """A class that fulfils `kind`'s contract (rlx.protocols), with methods of the right shape."""
    from rlx.protocols import ATTRIBUTES, CONTRACTS

    body = {"name": name or f"my-{kind}"}
    for m in CONTRACTS[kind]:
        args = ", ".join(["self", *m.args]) if m.check_args else "self, *args, **kwargs"
        prefix = "async " if m.kind == "async" else ""
        ns = {}
        exec(f"{prefix}def f({args}): return None", ns)
        body[m.name] = ns["f"]
    for attr, typ in ATTRIBUTES.get(kind, []):
        body[attr] = (f"type-of-{name or kind}",) if typ is tuple else "op"
    return type(f"C_{kind}", (), body)


def registering(*components):
    def hook(register):
        for c in components:
            register(c)

    return hook


def test_every_registration_kind_is_collected_and_reported():
    from rlx.hookspecs import KINDS

    hooks = {"register_rewards": registering(conforming("rewards")),
             "register_advantages": registering(conforming("advantages")),
             "register_losses": registering(conforming("losses")),
             "register_balancers": registering(conforming("balancers")),
             "register_transports": registering(conforming("transports")),
             "register_generators": registering(conforming("generators")),
             "register_models": registering(conforming("models")),
             "register_kernels": registering(conforming("kernels")),
             "register_agents": registering(conforming("agents")),
             "register_loggers": registering(conforming("loggers"))}
    assert set(hooks) == {f"register_{k}" for k in KINDS}
    p = build_plugins(entry_points=False, extra=[("all-kinds", _plugin("all-kinds", **hooks))])
    info = next(i for i in p.infos if i.name == "all-kinds")
    assert info.to_dict()["registers"] == {k: [f"my-{k}"] for k in KINDS}
    for kind in info.registers:
        assert p.get(kind, f"my-{kind}").name == f"my-{kind}"


@pytest.mark.parametrize("kind", ["rewards", "advantages", "losses", "balancers", "transports", "generators",
                                  "models", "kernels", "agents", "loggers"])
def test_a_component_missing_a_method_fails_at_load_naming_plugin_component_and_method(kind):
    from rlx.protocols import CONTRACTS

    cls = conforming(kind, "broken")
    missing = CONTRACTS[kind][0].name
    delattr(cls, missing)
    mod = _plugin("half-done", **{f"register_{kind}": lambda register: register(cls)})
    with pytest.raises(PluginError) as e:
        build_plugins(entry_points=False, extra=[("half-done", mod)])
    msg = str(e.value)
    assert "'half-done'" in msg and "'broken'" in msg and "protocol member" in msg and missing in msg


def test_wrong_signatures_and_sync_async_mismatches_fail_at_load():
    class SyncTransport:
        name = "sync-transport"

        def setup(self, ctx): ...
        async def send(self, named, version, ctx): ...
        async def commit(self, version, ctx): ...
        async def close(self): ...

    class GreedyLoss:
        name = "greedy"

        def loss(self, inputs, extra): ...

    class Shapeless:
        name = "shapeless"
        model_types = "qwen3"  # a string, not a tuple

        def spec(self, hf_config): ...

    for hook, cls, words in [("register_transports", SyncTransport, "method setup must be async"),
                             ("register_losses", GreedyLoss, "requires argument(s) the caller never passes: extra"),
                             ("register_models", Shapeless, "'model_types' of type tuple")]:
        mod = _plugin("bad", **{hook: registering(cls)})
        with pytest.raises(PluginError, match=re.escape(words)):
            build_plugins(entry_points=False, extra=[("bad", mod)])


def test_an_advantage_estimator_is_not_a_policy_loss():
    from rlx.config import parse_config
    from rlx.errors import ConfigError
    from rlx.preflight import config_checks

    p = build_plugins(entry_points=False)
    with pytest.raises(ConfigError) as e:
        parse_config("model: {path: /m}\ntrain:\n  objective: {advantage: ppo_clip, loss: grpo}\n",
                     checks=config_checks(p))
    msg = str(e.value)
    assert "<config>:3: train.objective.advantage.name: no advantage estimator named 'ppo_clip'" in msg
    assert "train.objective.loss.name: no policy loss named 'grpo'" in msg


def test_build_instantiates_with_validated_args_and_names_a_failing_plugin():
    p = build_plugins(entry_points=False)
    assert p.build("advantages", "grpo").config.normalize_std is True
    assert p.build("losses", {"name": "ppo_clip", "args": {"eps_high": 0.3}}).clip.eps_high == 0.3

    class Fragile:
        name = "fragile"

        def __init__(self):
            raise OSError("no GPU here")

        def score(self, sample): ...

    mod = _plugin("fragile-plugin", register_rewards=lambda register: register(Fragile))
    p = build_plugins(entry_points=False, extra=[("fragile-plugin", mod)])
    with pytest.raises(PluginError, match="reward 'fragile' from plugin 'fragile-plugin' failed to start: "
                                          "OSError: no GPU here"):
        p.build("rewards", "fragile")


def test_model_bridges_are_selected_by_model_type_and_may_not_overlap():
    p = build_plugins(entry_points=False)
    assert p.bridge_for("qwen3").name == "llama"
    with pytest.raises(RLXError, match="no model bridge for model_type 'gpt_oss'.*install the model plugin"):
        p.bridge_for("gpt_oss")
    with pytest.raises(RLXError, match="'glm4_moe' checkpoint needs the rlx-model-glm model plugin"):
        p.bridge_for("glm4_moe")  # a family rlx ships as a plugin is named

    class OldQwen:  # a release of the family's plugin from before it claimed the published Qwen3.5
        name = "old-qwen"
        model_types = ("qwen3_moe",)

        def spec(self, hf_config): ...

    old = build_plugins(entry_points=False, extra=[("qwen", _plugin("rlx-model-qwen", register_models=lambda register:
                                                                      register(OldQwen)))])
    with pytest.raises(RLXError, match=r"the installed rlx-model-qwen - does not claim model_type 'qwen3_5' \(it "
                                       r"claims qwen3_moe\): upgrade it"):
        old.bridge_for("qwen3_5")

    class Rival:
        name = "rival"
        model_types = ("mistral",)

        def spec(self, hf_config): ...

    mod = _plugin("rival-plugin", register_models=lambda register: register(Rival))
    with pytest.raises(PluginError) as e:
        build_plugins(entry_points=False, extra=[("rival-plugin", mod)])
    assert "model_type 'mistral'" in str(e.value) and "'llama'" in str(e.value) and "'rival-plugin'" in str(e.value)


def test_static_and_class_methods_fulfil_a_contract():
    class StaticReward:
        name = "static-reward"

        @staticmethod
        def score(sample):
            return 1.0

    class ClassBalancer:
        name = "class-balancer"

        @classmethod
        def partition(cls, lengths, k, flops):
            return [list(range(len(lengths)))] + [[] for _ in range(k - 1)]

    mod = _plugin("methods", register_rewards=registering(StaticReward), register_balancers=registering(ClassBalancer))
    p = build_plugins(entry_points=False, extra=[("methods", mod)])
    assert p.build("balancers", "class-balancer").partition([3, 4], 2, None) == [[0, 1], []]


def test_a_plain_function_is_a_component_where_the_contract_is_one_method():
    """As TRL and slime take reward functions: ``def my_reward(sample) -> float`` registers as a reward named after
    the function (or its ``name`` attribute); a loss likewise. A function for a kind of several methods does not."""

    def my_reward(sample):
        return float(len(sample.response_ids))

    def clipped(inputs):
        return inputs

    clipped.name = "my_loss"
    mod = _plugin("mine", register_rewards=lambda register: register(my_reward),
                  register_losses=lambda register: register(clipped))
    p = build_plugins(entry_points=False, extra=[("mine", mod)])
    reward = p.build("rewards", "my_reward")
    assert reward.score(Sample([1], [2, 3], [1, 1], [0.0, 0.0])) == 2.0 and reward.function is my_reward
    assert p.build("losses", "my_loss").loss("x") == "x"
    bad = _plugin("bad", register_transports=lambda register: register(my_reward))
    with pytest.raises(PluginError, match="registered a transport .* without a string `name`"):
        build_plugins(entry_points=False, extra=[("bad", bad)])


def test_keep_going_leaves_out_a_broken_plugin_with_its_error():
    class NoScore:
        name = "broken"

    bad = _plugin("bad", register_rewards=lambda register: register(NoScore))
    good = _plugin("good", register_rewards=lambda register: register(Reward))
    with pytest.raises(PluginError, match='is missing the "Reward" protocol member score'):
        build_plugins(entry_points=False, extra=[("bad", bad), ("good", good)])
    p = build_plugins(entry_points=False, extra=[("bad", bad), ("good", good)], keep_going=True)
    infos = {i.name: i for i in p.infos}
    assert 'is missing the "Reward" protocol member score: score(sample)' in infos["bad"].error and infos["bad"].registers == {}
    assert infos["good"].error is None and p.get("rewards", "double") is Reward and "broken" not in p.names("rewards")
