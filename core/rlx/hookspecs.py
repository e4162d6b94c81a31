"""Every hook rlx calls, with its contract. Specs only: importing this module is cheap.

Two families:

* Registration hooks, ``register_<kind>(register)``: a plugin calls ``register(component)`` once per
  component it provides. A component is a class (or object) with a string attribute ``name``; config
  selects components by that name. Two components of one kind with one name is an error naming both
  plugins. Called once, when the plugin manager is built.
* Lifecycle hooks: few and typed; called by the train loop and the rollout manager.

A plugin is any module or object with functions marked ``@rlx.hookimpl`` whose names and arguments
match a spec below; a misspelled name or argument is rejected when the plugin loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import typer

    from rlx.types import Group, RolloutBatch

PROJECT = "rlx"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[Any], None]

#: The registration kinds, in the order `rl plugins` shows them. Each has a `register_<kind>` hook.
KINDS = ("rewards", "losses", "balancers", "transports", "generators", "models", "kernels", "agents")


@hookspec
def register_rewards(register: Register) -> None:
    """Register reward components.

    A reward has ``name`` and ``score(sample) -> RewardResult | float`` (a plain or ``async`` method);
    it may define a pydantic ``Config`` class, validated from the reward's ``args`` in config and passed
    to ``__init__(config)``. An exception inside ``score`` marks that sample FAILED, not the run.

    :param register: call once per reward class.
    """


@hookspec
def register_losses(register: Register) -> None:
    """Register policy losses and advantage estimators (GRPO, PPO-clip, GSPO, REINFORCE++, ...).

    :param register: call once per loss or estimator class.
    """


@hookspec
def register_balancers(register: Register) -> None:
    """Register data balancers, which partition a step's samples across data-parallel ranks.

    :param register: call once per balancer class.
    """


@hookspec
def register_transports(register: Register) -> None:
    """Register weight transports, which move trainer weights into the engines (tensor, broadcast,
    disk, delta).

    :param register: call once per transport class.
    """


@hookspec
def register_generators(register: Register) -> None:
    """Register generators, which turn a prompt into samples by talking to the engines (single-turn,
    multi-turn, agent).

    :param register: call once per generator class.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model bridges, which build a Megatron model from an HF checkpoint and convert weights
    both ways.

    :param register: call once per model bridge class.
    """


@hookspec
def register_kernels(register: Register) -> None:
    """Register optional kernels (e.g. gated delta net) that model bridges may select by name.

    :param register: call once per kernel class.
    """


@hookspec
def register_agents(register: Register) -> None:
    """Register agent harnesses that the agent generator runs against the API adapters.

    An agent is a class with ``name`` and ``async def run(self, base_url, api_key, task) -> float | None``:
    it talks to the OpenAI/Anthropic-compatible adapter at `base_url` with `api_key` (which routes to
    the sample's own session) and returns the reward, or None to leave scoring to ``rollout.rewards``.
    Select it with ``rollout.generator: {name: agent, args: {function: <its name>}}``.

    :param register: call once per agent class.
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
    """Called once a rollout step's batch is complete, before training sees it.

    :param batch: the batch; implementations may read it and add to ``batch.metrics``.
    """


@hookspec
def on_train_step_end(step: int, metrics: dict[str, float]) -> None:
    """Called after each optimizer step, with the metrics about to be logged.

    :param step: the step just finished (1-based).
    :param metrics: the step's metrics; implementations may add to it.
    """
