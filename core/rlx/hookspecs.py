"""Every hook rlx calls, with its contract. Specs only: importing this module is cheap.

Two families:

* Registration hooks, ``register_<kind>(register)``: a plugin calls ``register(component)`` once per
  component it provides. A component is a class (or object) with a string attribute ``name``; config
  selects components by that name. Two components of one kind with one name is an error naming both
  plugins. Called once, when the plugin manager is built. Each kind has a typed contract
  (`rlx.protocols`) checked at registration: a missing or mis-shaped method fails the load, naming
  plugin, component and method. The hook's argument is typed by kind (`Register`), so that a type checker
  holds a component to the same contract where it is registered.
* Lifecycle hooks: few and typed; called by the train loop and the rollout manager.

A plugin is any module or object with functions marked ``@rlx.hookimpl`` whose names and arguments
match a spec below; a misspelled name or argument is rejected when the plugin loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pluggy

from rlx.protocols import (AdvantageEstimator, Agent, Balancer, Generator, Kernel, Logger, PolicyLoss, Reward,
                           Transport)

if TYPE_CHECKING:
    from collections.abc import Awaitable

    import typer

    from rlx.types import Group, RewardResult, RolloutBatch, Sample

PROJECT = "rlx"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

C = TypeVar("C", contravariant=True)


class Register(Protocol[C]):
    """What a ``register_<kind>`` hook is handed: call it once per component, a class or an instance. Typed by
    kind, so that a type checker holds a plugin's component to the kind's contract (`rlx.protocols`), as
    registration does: annotate the hook's argument as the spec below does (``register: Register[...]``)."""

    def __call__(self, component: C, /) -> None: ...


#: A reward may also be a plain function of the sample (sync or async) returning a number or a `RewardResult`.
RewardFunction = Callable[["Sample"], "float | RewardResult | Awaitable[float | RewardResult]"]

#: Each kind's `Register`, to annotate a ``register_<kind>`` hook with (models: ``Register[type[ModelBridge]]``,
#: `rlx.train.spec.ModelBridge`).
RegisterRewards = Register[type[Reward] | Reward | RewardFunction]
RegisterAdvantages = Register[type[AdvantageEstimator] | AdvantageEstimator]
RegisterLosses = Register[type[PolicyLoss] | PolicyLoss]
RegisterBalancers = Register[type[Balancer] | Balancer]
RegisterTransports = Register[type[Transport] | Transport]
RegisterGenerators = Register[type[Generator] | Generator]
RegisterKernels = Register[type[Kernel] | Kernel]
RegisterAgents = Register[type[Agent] | Agent]
RegisterLoggers = Register[type[Logger] | Logger]

#: The registration kinds, in the order `rl plugins` shows them. Each has a `register_<kind>` hook.
KINDS = ("rewards", "advantages", "losses", "balancers", "transports", "generators", "models", "kernels", "agents",
         "loggers")


@hookspec
def register_rewards(register: RegisterRewards) -> None:
    """Register reward components.

    A reward has ``name`` and ``score(sample) -> RewardResult | float`` (a plain or ``async`` method);
    it may define a pydantic ``Config`` class, validated from the reward's ``args`` in config and passed
    to ``__init__(config)``. An exception inside ``score`` marks that sample FAILED, not the run.

    :param register: call once per reward class.
    """


@hookspec
def register_advantages(register: RegisterAdvantages) -> None:
    """Register advantage estimators (GRPO, REINFORCE++, ...), selected by ``train.objective.advantage``.

    An estimator has ``advantages(groups) -> {sample_id: float | per-token sequence}``.

    :param register: call once per estimator class.
    """


@hookspec
def register_losses(register: RegisterLosses) -> None:
    """Register policy losses (PPO-clip, GSPO, ...), selected by ``train.objective.loss``.

    A policy loss has ``loss(inputs: LossInputs) -> (per_token_loss, clipped)``.

    :param register: call once per loss class.
    """


@hookspec
def register_balancers(register: RegisterBalancers) -> None:
    """Register data balancers, which partition a step's samples across data-parallel ranks:
    ``partition(lengths, k, flops) -> [indices per rank]``.

    :param register: call once per balancer class.
    """


@hookspec
def register_transports(register: RegisterTransports) -> None:
    """Register weight transports, which move trainer weights into the engines (tensor, broadcast,
    disk, delta): ``async setup(ctx)``, ``async send(named, version, ctx)`` on every sending rank,
    ``async commit(version, ctx)`` once all have sent, ``async close()``. See `rlx.transport`.

    :param register: call once per transport class.
    """


@hookspec
def register_generators(register: RegisterGenerators) -> None:
    """Register generators, which turn a prompt into samples by talking to the engines (single-turn,
    multi-turn, agent).

    :param register: call once per generator class.
    """


@hookspec
def register_models(register: Register[Any]) -> None:
    """Register model bridges: a class with ``name``, ``model_types`` (the HF ``model_type`` values it
    claims) and ``spec(hf_config) -> rlx.train.spec.ModelSpec``: the contract `rlx.train.spec.ModelBridge`, beside
    the model API it is written against (annotate ``register: Register[type[ModelBridge]]`` to have it checked).
    A checkpoint selects its bridge by its ``model_type``; two bridges claiming one type is an error naming both.

    :param register: call once per model bridge class.
    """


@hookspec
def register_kernels(register: RegisterKernels) -> None:
    """Register optional kernels (e.g. gated delta net) that model bridges may select by name: ``name``,
    ``op`` (the operation), ``supports(**query) -> None | reason`` and ``__call__``.

    :param register: call once per kernel class.
    """


@hookspec
def register_agents(register: RegisterAgents) -> None:
    """Register agent harnesses that the agent generator runs against the API adapters.

    An agent is a class with ``name`` and ``async def run(self, base_url, api_key, task) -> float | None``:
    it talks to the OpenAI/Anthropic-compatible adapter at `base_url` with `api_key` (which routes to
    the sample's own session) and returns the reward, or None to leave scoring to ``rollout.rewards``.
    Select it with ``rollout.generator: {name: agent, args: {function: <its name>}}``.

    :param register: call once per agent class.
    """


@hookspec
def register_loggers(register: RegisterLoggers) -> None:
    """Register experiment loggers, selected by ``run.loggers``: ``open(run)`` once (a `RunInfo`: output
    folder, resolved config), ``log_metrics(step, metrics)`` every step, ``log_samples(step, rows)`` every
    ``run.log_samples_interval`` steps (rows of prompt, response, reward), ``close()`` at the end.

    :param register: call once per logger class.
    """


@hookspec
def register_commands(app: typer.Typer) -> None:
    """Add sub-commands to the ``rl`` CLI.

    :param app: the root typer application; add commands or sub-apps to it.
    """


@hookspec
def filter_group(group: Group) -> bool | None:
    """Decide whether a finished group is kept for training (dynamic sampling).

    Called for every group after rewards are scored; the group is dropped if any implementation
    returns ``False``. ``None`` means no opinion.

    :param group: the scored group.
    """


@hookspec
def on_rollout_end(batch: RolloutBatch) -> None:
    """Called once per batch, when it is complete and before training sees it, whatever its source (sync,
    async or the rollout buffer): by the training step, or by ``rl rollout`` for the batches it writes.

    :param batch: the batch; implementations may read it and add to ``batch.metrics``.
    """


@hookspec
def on_train_step_end(step: int, metrics: dict[str, float]) -> None:
    """Called after each optimizer step, with the metrics about to be logged.

    :param step: the step just finished (1-based).
    :param metrics: the step's metrics; implementations may add to it.
    """
