"""The typed contract of every component kind, checked when a plugin registers a component.

Each kind has a `typing.Protocol` (for readers, type checkers and IDEs) and a list of `Method`s that
`check_component` enforces at registration: a component missing a method, with a method that takes the
wrong number of arguments, or a coroutine where a plain function is due (or the other way round) is a
`PluginError` naming the plugin, the component and the method, before any run starts.

Kinds and what config selects them:

=============  ==========================================  =================================
kind           contract                                    selected by
=============  ==========================================  =================================
rewards        ``score(sample)`` (plain or async)          ``rollout.rewards[i].name``
generators     ``async generate(ctx, sample)``             ``rollout.generator``
advantages     ``advantages(groups)``                      ``train.objective.advantage``
losses         ``loss(inputs)``                            ``train.objective.loss``
balancers      ``partition(lengths, k, flops)``            ``train.balancer``
transports     ``async setup/send/commit/close``           ``weight_sync.transport``
models         ``spec(hf_config) -> ModelSpec``            the checkpoint's ``model_type``
kernels        ``supports(**query)``, ``__call__``         by name, from model bridges
agents         ``async run(base_url, api_key, task)``      ``rollout.generator.args.function``
loggers        ``open(run)``, ``log_metrics``, ``log_samples``  ``run.loggers``
=============  ==========================================  =================================

A component is a class (instantiated with its validated ``Config`` when it has one) or an object.
Only methods are checked; what they return is checked where it is used, with the component named.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from rlx.types import GenerateResult, Group, RewardResult, Sample

if TYPE_CHECKING:
    import torch

    from rlx.config import SamplingConfig


@runtime_checkable
class Reward(Protocol):
    name: str  # config selects the component by it (a class attribute)

    def score(self, sample: Sample) -> RewardResult | float | Awaitable[RewardResult | float]: ...  # or async def


class Generation(Protocol):
    """What a generator calls to generate (rlx passes `rlx.rollout.context.GenerateContext`): the engines
    behind the run's router, with its sampling settings and its request ids."""

    tokenizer: Any  # the model's transformers tokenizer
    sampling: SamplingConfig  # rollout.sampling
    context_length: int | None  # the engines' context length, when they report one

    def sampling_params(self, already: int = 0, **overrides: Any) -> dict[str, Any]: ...

    def new_rid(self, sample: Sample) -> str: ...

    async def generate(self, input_ids: list[int], params: dict[str, Any],
                       rid: str | None = None) -> GenerateResult: ...


@runtime_checkable
class Generator(Protocol):
    name: str  # config selects the component by it (a class attribute)

    async def generate(self, ctx: Generation, sample: Sample) -> list[Sample]: ...


@runtime_checkable
class AdvantageEstimator(Protocol):
    """Advantages of the trainable samples: one number per sample (broadcast over its tokens) or one per
    response token. Keys are sample ids; a trainable sample left out is not trained on.

    An estimator with a critic sets the class attribute ``needs_critic = True`` and implements
    ``advantages_and_returns(groups, values, kl=None, kl_coef=0.0) -> (advantages, returns)`` (per sample id,
    lists over response tokens; `values` the critic's, `kl` per-token KL to the reference for the reward):
    the trainer then builds a critic (``train.critic``) and calls that instead (see the built-in ``gae``)."""

    name: str  # config selects the component by it (a class attribute)

    def advantages(self, groups: list[Group]) -> Mapping[int, float | Sequence[float]]: ...


class CriticEstimator(AdvantageEstimator, Protocol):
    """An estimator with a critic (``needs_critic = True``, like the built-in ``gae``): advantages and the critic's
    targets (returns) from its values, per sample id and response token; `kl`, per-token KL to the reference, goes
    into the reward times `kl_coef`."""

    needs_critic: bool

    def advantages_and_returns(self, groups: list[Group], values: Mapping[int, Sequence[float]],
                               kl: Mapping[int, Sequence[float]] | None = None, kl_coef: float = 0.0
                               ) -> tuple[Mapping[int, Sequence[float]], Mapping[int, Sequence[float]]]: ...


@runtime_checkable
class PolicyLoss(Protocol):
    """Per-token policy loss (to minimise) and a per-token bool of where it was clipped."""

    name: str  # config selects the component by it (a class attribute)

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class LossInputs:
    """Flat per-token tensors ``[T]`` of one packed micro-batch (response tokens only)."""

    logprobs: torch.Tensor  # current policy, with grad
    old_logprobs: torch.Tensor  # trainer's, before this update
    rollout_logprobs: torch.Tensor  # the engine's (0 where it reported none)
    advantages: torch.Tensor
    weights: torch.Tensor  # normalisation weight per token, 0 where the loss mask is 0
    mask: torch.Tensor  # 1.0 on model-sampled tokens
    seq_index: torch.Tensor  # sequence (0..n-1) of each token, for sequence-level losses
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    has_rollout: torch.Tensor | None = None  # 1.0 where the engine's log-prob exists (None: everywhere)


@runtime_checkable
class Balancer(Protocol):
    """Indices of the samples (by length) for each of `k` data-parallel ranks."""

    name: str  # config selects the component by it (a class attribute)

    def partition(self, lengths: list[int], k: int, flops: Flops | None) -> list[list[int]]: ...


class Flops(Protocol):
    """The cost of a sample by its length (rlx passes the model's `rlx.train.balance.FlopsModel`)."""

    def cost(self, length: int) -> float: ...


@runtime_checkable
class Transport(Protocol):
    """Moves trainer weights into the engines. See `rlx.transport` for the push protocol."""

    name: str  # config selects the component by it (a class attribute)

    async def setup(self, ctx: TransportContext) -> None: ...

    async def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int, ctx: TransportContext) -> None: ...

    async def commit(self, version: int, ctx: TransportContext) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Adapter:
    """A push of a LoRA adapter instead of weights (``train.lora.push: adapter``): the tensors sent are the adapter's,
    by peft's names (``base_model.model.<module>.lora_A.weight``, ``lora_B``), from one sender, whole; the transport
    makes the engines serve them beside the base model as `name` (the name requests give as ``lora_path``: a new one
    each push, so a request in flight keeps the adapter it started with), then sets the weight version. A transport
    that can carry adapters says so with a class attribute ``adapters = True``."""

    name: str  # what the engines serve it as ("actor-v3-9f2c1a")
    config: dict[str, Any]  # peft's adapter_config (r, lora_alpha, target_modules, ...)


@dataclass
class TransportContext:
    """What a transport instance on one sending rank knows about the push."""

    engines: list[Any]  # the engines that take weights: each has `url` and `client(timeout_s=...)`
    output_dir: Path  # the run's output folder (shared storage for disk-based transports)
    sender: int = 0  # this sender's index (its pipeline stage)
    senders: int = 1  # how many ranks send parts of each push
    host: str = "127.0.0.1"  # this sender's address, where engines can reach it (rendezvous servers)
    adapter: Adapter | None = None  # pushes carry this LoRA adapter, not weights (see `Adapter`)


@runtime_checkable
class Kernel(Protocol):
    """An optional fast implementation of one operation (``op``, e.g. ``"gdn"``).

    ``supports(**query)`` returns None when the kernel can run for the query (device, dtype, shapes),
    else the reason it cannot, checked before anything heavy is imported.
    """

    name: str  # config selects the component by it (a class attribute)
    op: str  # the operation it implements (a class attribute)

    def supports(self, **query: Any) -> str | None: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class Agent(Protocol):
    name: str  # config selects the component by it (a class attribute)

    async def run(self, base_url: str, api_key: str, task: dict[str, Any]) -> float | None: ...


@runtime_checkable
class Logger(Protocol):
    """An experiment tracker: opened once with the run (its output folder and resolved config), then given
    every step's metrics and, every few steps, a table of samples; closed at the end of the run."""

    name: str  # config selects the component by it (a class attribute)

    def open(self, run: RunInfo) -> None: ...

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None: ...

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


@dataclass
class RunInfo:
    """What a logger learns about the run when it opens."""

    name: str  # run.name
    output_dir: Path  # where metrics.jsonl and checkpoints go; a logger writes beside them
    config: dict[str, Any]  # the resolved config tree, as YAML would spell it
    resumed_from: int | None = None  # the step a resumed run continues after (None: a fresh run)


# -- what registration checks ------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    name: str
    args: tuple[str, ...]  # positional arguments after self, by their contract names
    kind: Literal["sync", "async", "either"] = "sync"
    check_args: bool = True  # False: the arguments depend on the component (a kernel's op)

    def describe(self) -> str:
        prefix = "async " if self.kind == "async" else ""
        return f"{prefix}{self.name}({', '.join(self.args)})"


CONTRACTS: dict[str, list[Method]] = {
    "rewards": [Method("score", ("sample",), "either")],
    "generators": [Method("generate", ("ctx", "sample"), "async")],
    "advantages": [Method("advantages", ("groups",))],
    "losses": [Method("loss", ("inputs",))],
    "balancers": [Method("partition", ("lengths", "k", "flops"))],
    "transports": [Method("setup", ("ctx",), "async"), Method("send", ("named", "version", "ctx"), "async"),
                   Method("commit", ("version", "ctx"), "async"), Method("close", (), "async")],
    "models": [Method("spec", ("hf_config",))],
    "kernels": [Method("supports", ()), Method("__call__", (), check_args=False)],
    "agents": [Method("run", ("base_url", "api_key", "task"), "async")],
    "loggers": [Method("open", ("run",)), Method("log_metrics", ("step", "metrics")),
                Method("log_samples", ("step", "rows")), Method("close", ())],
}

#: Class attributes a kind needs beside ``name``: (attribute, the type its value must have).
#: Each kind's Protocol, by the name a type checker says (``rlx.train.spec.ModelBridge`` for models).
PROTOCOL_NAMES = {"rewards": "Reward", "generators": "Generator", "advantages": "AdvantageEstimator",
                  "losses": "PolicyLoss", "balancers": "Balancer", "transports": "Transport", "models": "ModelBridge",
                  "kernels": "Kernel", "agents": "Agent", "loggers": "Logger"}

ATTRIBUTES: dict[str, list[tuple[str, type]]] = {
    "models": [("model_types", tuple)],
    "kernels": [("op", str)],
}


class FunctionComponent:
    """A plain function registered as a component whose contract is one method: an object with that method (the
    function itself, so ``async def`` stays async) and the function's ``name`` attribute or else its own name.

    A class at module level, so that the object pickles wherever its function does: a reward goes to its worker
    processes this way (`rlx.rollout.rewards`), by reference for a module's function and by value (cloudpickle)
    for a closure made by a factory."""

    def __init__(self, fn: Callable[..., Any], method: str):
        self.name: str = getattr(fn, "name", fn.__name__)
        self.function = fn
        self.__doc__ = fn.__doc__
        setattr(self, method, fn)  # in the instance's __dict__: the contract check finds it there

    def __repr__(self) -> str:
        return f"<{self.name}: {getattr(self.function, '__module__', '?')}.{self.function.__qualname__}>"


def as_component(kind: str, obj: object) -> object:
    """A plain function registered as a component whose contract is one method (a reward's ``score``, a loss's
    ``loss``, an estimator's ``advantages``, a balancer's ``partition``, a generator's ``generate``, an agent's
    ``run``, a bridge's ``spec``) becomes a `FunctionComponent` with that method, as TRL and slime take reward
    functions. A lambda needs a ``name`` attribute (config selects components by name, and ``<lambda>`` names
    none). Anything else is returned as it is."""
    methods = CONTRACTS.get(kind, [])
    if not inspect.isfunction(obj) or len(methods) != 1:
        return obj
    if obj.__name__ == "<lambda>" and not isinstance(getattr(obj, "name", None), str):
        raise ValueError(f"a lambda ({obj.__module__}, line {obj.__code__.co_firstlineno}) has no name for config to "
                         f"select it by: write it as a def, or set its name first (fn.name = 'my_reward')")
    return FunctionComponent(obj, methods[0].name)


def contract_problems(kind: str, obj: object) -> list[str]:
    """What `obj` lacks to be a component of `kind` (empty when it fulfils the contract)."""
    problems = []
    for attr, typ in ATTRIBUTES.get(kind, []):
        if not isinstance(getattr(obj, attr, None), typ):
            problems.append(f"needs a class attribute {attr!r} of type {typ.__name__}")
    for m in CONTRACTS[kind]:
        fn = _lookup(obj, m.name)
        if fn is None or not callable(fn):
            # a type checker's words: `"X" is missing following "Transport" protocol member: commit`
            problems.append(f'is missing the "{PROTOCOL_NAMES[kind]}" protocol member {m.name}: {m.describe()}')
            continue
        is_async = inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
        if m.kind == "async" and not is_async:
            problems.append(f"method {m.name} must be async ({m.describe()})")
        elif m.kind == "sync" and is_async:
            problems.append(f"method {m.name} must not be async ({m.describe()})")
        raw = _static(obj, m.name)
        # a plain function looked up on a class still takes self; a bound method, a staticmethod or a
        # classmethod takes only the contract's arguments
        bound = not inspect.isclass(obj) or isinstance(raw, (staticmethod, classmethod))
        why = _arity_problem(fn, len(m.args), bound=bound)
        if why and m.check_args:
            problems.append(f"method {m.name} {why}; the contract is {m.describe()}")
    return problems


def _lookup(obj: object, name: str) -> Any:
    """The attribute `name` as the component defines it (not ``object``'s or ``type``'s own)."""
    if not inspect.isclass(obj) and name in getattr(obj, "__dict__", {}):
        return getattr(obj, name)
    cls = obj if inspect.isclass(obj) else type(obj)
    if any(name in vars(c) for c in cls.__mro__ if c is not object):
        return getattr(obj, name)
    return None


def _static(obj: object, name: str) -> object:
    try:
        return inspect.getattr_static(obj, name)
    except AttributeError:
        return None


def _arity_problem(fn: Callable[..., Any], n: int, bound: bool) -> str | None:
    """None if `fn` accepts exactly the contract's `n` positional arguments (after self), else why not."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins without signatures: cannot tell, let it through
    params = list(sig.parameters.values())
    if not bound and params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]  # self (an unbound method of a class)
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    required_kw = [p for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if len(required) > n or required_kw:
        extra = [p.name for p in required[n:]] + [p.name for p in required_kw]
        return f"requires argument(s) the caller never passes: {', '.join(extra)}"
    if len(positional) < n:
        return f"takes {len(positional)} positional argument(s), but is called with {n}"
    return None


def describe_contract(kind: str) -> str:
    """One line per required method, for error messages and docs."""
    return ", ".join(m.describe() for m in CONTRACTS[kind])
