"""The plugin manager: built-ins first, then entry points in group ``rlx.plugins``, behind a typed facade.

Choices:

* The manager is built by `build_plugins()`, never at import time: once per process (`process_plugins`) where no
  caller hands one over; tests build a fresh one each.
* Built-in features are ordinary plugins (`BUILTIN_PLUGINS`), registered exactly like
  third-party ones.
* ``RLX_LOAD_PLUGINS=a,b`` loads only those entry-point plugins (empty: none);
  ``RLX_DISABLE_PLUGINS=a,b`` skips plugins by name, built-ins included (to replace one).
* Hook implementations are validated before registration so that a misspelled hook or argument is an
  error naming the plugin, the hook and the argument; ``check_pending()`` runs after loading as well.
* Components are collected per plugin, so that every component knows who registered it and two
  components with one name name both plugins.
* Call sites use `Plugins` (the typed facade), never ``pm.hook``.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import inspect
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, overload

import pluggy

from rlx import hookspecs
from rlx.errors import PluginError, RLXError
from rlx.hookspecs import KINDS, PROJECT
from rlx.protocols import FunctionComponent, as_component, contract_problems, describe_contract

if TYPE_CHECKING:
    import typer

    from rlx.config import ComponentSpec

    from rlx.protocols import AdvantageEstimator, Agent, Balancer, Generator, Logger, PolicyLoss, Reward, Transport

    from rlx.types import Group, RolloutBatch

ENTRY_POINT_GROUP = "rlx.plugins"

#: How messages name one component of each kind.
#: What config names a component by: a ``ComponentSpec``, or its YAML form (a bare name, or ``{name, args}``).
ComponentRef: TypeAlias = "ComponentSpec | str | dict[str, Any]"

KIND_NAMES = {"rewards": "reward", "advantages": "advantage estimator", "losses": "policy loss",
              "balancers": "balancer", "transports": "transport", "generators": "generator",
              "models": "model bridge", "kernels": "kernel", "agents": "agent", "loggers": "logger"}


@dataclass
class PluginInfo:
    """One loaded plugin, as ``rl plugins`` shows it."""

    name: str
    distribution: str
    version: str
    registers: dict[str, list[str]] = field(default_factory=dict)  # kind -> component names
    error: str | None = None  # why it did not load (`build_plugins(keep_going=True)`: the others load)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "registers": {k: list(v) for k, v in self.registers.items()},
            "error": self.error,
        }


@dataclass
class Component:
    """A registered component: what it is, its kind, and the plugin that registered it."""

    name: str
    kind: str
    obj: Any
    plugin: str


class Plugins:
    """Typed facade over the pluggy manager: components by kind and name, and the lifecycle hooks."""

    def __init__(self, pm: pluggy.PluginManager, infos: list[PluginInfo], keep_going: bool = False):
        """`keep_going`: a plugin whose components fail to register is left out, its error in its `PluginInfo`
        (``rl plugins``); else that error is raised."""
        self.pm = pm
        self.infos = infos
        while True:
            self.components: dict[str, dict[str, Component]] = {k: {} for k in KINDS}
            self._bridges: dict[str, Component] = {}  # model_type -> model bridge
            for info in infos:
                info.registers = {}
            try:
                self._collect()
                return
            except PluginError as e:
                if not keep_going or e.plugin is None or not pm.has_plugin(e.plugin):
                    raise
                next(i for i in infos if i.name == e.plugin).error = str(e)
                pm.unregister(name=e.plugin)

    # -- components ----------------------------------------------------------------------------

    def _collect(self) -> None:
        by_name = {info.name: info for info in self.infos}
        for kind in KINDS:
            caller = getattr(self.pm.hook, f"register_{kind}")
            # get_hookimpls() is in registration order: built-ins claim their names first.
            for impl in caller.get_hookimpls():
                plugin_name = impl.plugin_name

                def register(obj: object, _plugin: str = plugin_name, _kind: str = kind) -> None:
                    self._add(_kind, obj, _plugin)

                try:
                    impl.function(register=register)
                except RLXError:
                    raise
                except Exception as e:
                    raise PluginError(
                        f"plugin {plugin_name!r} raised in register_{kind}: {type(e).__name__}: {e}", plugin_name
                    ) from e
            for comp in self.components[kind].values():
                by_name[comp.plugin].registers.setdefault(kind, []).append(comp.name)

    def _add(self, kind: str, obj: object, plugin: str) -> None:
        try:
            obj = as_component(kind, obj)
        except ValueError as e:
            raise PluginError(f"plugin {plugin!r} registered a {KIND_NAMES[kind]} that cannot be one: {e}",
                              plugin) from None
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(
                f"plugin {plugin!r} registered a {KIND_NAMES[kind]} {obj!r} without a string `name` attribute", plugin
            )
        problems = contract_problems(kind, obj)
        if problems:
            raise PluginError(f"plugin {plugin!r}: {KIND_NAMES[kind]} {name!r} ({_qualname(obj)}) "
                              + "; ".join(problems) + f" [contract: {describe_contract(kind)}]", plugin)
        existing = self.components[kind].get(name)
        if existing is not None:
            raise PluginError(
                f"two {kind} named {name!r}: one from plugin {existing.plugin!r} "
                f"({_qualname(existing.obj)}), one from plugin {plugin!r} ({_qualname(obj)}); "
                f"disable one with RLX_DISABLE_PLUGINS", plugin
            )
        claims: tuple[str, ...] = getattr(obj, "model_types", ()) if kind == "models" else ()  # checked: a tuple
        if kind == "models":
            for mt in claims:
                other = self._bridges.get(mt)
                if other is not None:
                    raise PluginError(
                        f"two model bridges claim model_type {mt!r}: {other.name!r} from plugin {other.plugin!r} "
                        f"and {name!r} from plugin {plugin!r}; disable one with RLX_DISABLE_PLUGINS", plugin)
        self.components[kind][name] = Component(name, kind, obj, plugin)
        if kind == "models":
            for mt in claims:
                self._bridges[mt] = self.components[kind][name]

    def names(self, kind: str) -> list[str]:
        return sorted(self.components[_check_kind(kind)])

    def get(self, kind: str, name: str) -> Any:
        """The component of `kind` called `name`; an error listing the choices if there is none."""
        comps = self.components[_check_kind(kind)]
        if name in comps:
            return comps[name].obj
        raise RLXError(self.unknown_message(kind, name))

    def unknown_message(self, kind: str, name: str) -> str:
        """Why no component of `kind` is called `name`: the choices, and the plugins that failed to load (one of
        them may be the one that provides it)."""
        return unknown_component_message(kind, name, self.names(kind)) + self._failed_note()

    def _failed_note(self) -> str:
        """What a "there is none" message adds: the plugins that failed to load (each may be the one that provides
        what was asked for)."""
        return "".join(f"; plugin {i.name!r} ({i.distribution}) failed to load and may be the one: {i.error}"
                       for i in self.failed)

    @property
    def failed(self) -> list[PluginInfo]:
        """The plugins left out because they failed to load (`build_plugins(keep_going=True)`)."""
        return [i for i in self.infos if i.error]

    def component(self, kind: str, name: str) -> Component:
        self.get(kind, name)
        return self.components[kind][name]

    @overload
    def build(self, kind: Literal["rewards"], spec: ComponentRef) -> Reward: ...
    @overload
    def build(self, kind: Literal["generators"], spec: ComponentRef) -> Generator: ...
    @overload
    def build(self, kind: Literal["advantages"], spec: ComponentRef) -> AdvantageEstimator: ...
    @overload
    def build(self, kind: Literal["losses"], spec: ComponentRef) -> PolicyLoss: ...
    @overload
    def build(self, kind: Literal["balancers"], spec: ComponentRef) -> Balancer: ...
    @overload
    def build(self, kind: Literal["transports"], spec: ComponentRef) -> Transport: ...
    @overload
    def build(self, kind: Literal["agents"], spec: ComponentRef) -> Agent: ...
    @overload
    def build(self, kind: Literal["loggers"], spec: ComponentRef) -> Logger: ...
    @overload
    def build(self, kind: str, spec: ComponentRef) -> Any: ...

    def build(self, kind: str, spec: ComponentRef) -> Any:
        """An instance of the component a config entry selects (a ``ComponentSpec``, or a bare name):
        a class is instantiated with its ``Config`` validated from the entry's ``args``; an object is
        returned as it is. Typed per kind: the caller holds the kind's Protocol (`rlx.protocols`)."""
        from rlx.config import ComponentSpec, component_config

        spec = ComponentSpec.coerce(spec)
        spec = spec if isinstance(spec, ComponentSpec) else ComponentSpec.model_validate(spec)
        component = self.get(kind, spec.name)
        if not inspect.isclass(component):
            return component
        make: Callable[..., Any] = component  # a class of the kind's Protocol
        conf = component_config(component, spec.args)
        try:
            return make(conf) if conf is not None else make()
        except RLXError:
            raise
        except Exception as e:
            plugin = self.components[kind][spec.name].plugin
            raise PluginError(f"{KIND_NAMES[kind]} {spec.name!r} from plugin {plugin!r} failed to start: "
                              f"{type(e).__name__}: {e}") from e

    def has_bridge(self, model_type: str) -> bool:
        return model_type in self._bridges

    def bridge_for(self, model_type: str) -> Any:
        """The model bridge (an instance) that claims `model_type`."""
        comp = self._bridges.get(model_type)
        failed = self._failed_note()
        if comp is None and model_type in FAMILY_PLUGINS:
            dist, folder = FAMILY_PLUGINS[model_type]
            loaded = next((i for i in self.infos if i.distribution == dist and i.error is None), None)
            if loaded is not None:  # an older release of the family's plugin
                claims = sorted(mt for mt, c in self._bridges.items() if c.plugin == loaded.name)
                raise RLXError(f"model.path: the installed {dist} {loaded.version} does not claim model_type "
                               f"{model_type!r} (it claims {', '.join(claims) or 'none'}): upgrade it (from the rlx "
                               f"repository: pip install ./{folder})")
            raise RLXError(f"model.path: a {model_type!r} checkpoint needs the {dist} model plugin, which is not "
                           f"installed (or is disabled): pip install {dist} (from the rlx repository: pip install "
                           f"./{folder})" + failed)
        if comp is None:
            known = ", ".join(sorted(self._bridges)) or "none"
            raise RLXError(f"model.path: no model bridge for model_type {model_type!r} (bridges are installed for: "
                           f"{known}); install the model plugin for this family (`rl plugins` lists the "
                           f"bridges under models)" + failed)
        return comp.obj() if inspect.isclass(comp.obj) else comp.obj

    # -- lifecycle hooks -----------------------------------------------------------------------

    def keep_group(self, group: Group) -> bool:
        """False if any ``filter_group`` implementation rejects the group."""
        return all(r is not False for r in self.pm.hook.filter_group(group=group))

    def on_rollout_end(self, batch: RolloutBatch) -> None:
        self.pm.hook.on_rollout_end(batch=batch)

    def on_train_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.pm.hook.on_train_step_end(step=step, metrics=metrics)

    def add_commands(self, app: typer.Typer) -> None:
        self.pm.hook.register_commands(app=app)


def unknown_component_message(kind: str, name: str, choices: Iterable[str]) -> str:
    choices = sorted(choices)
    msg = f"no {KIND_NAMES.get(kind, kind)} named {name!r}"
    close = difflib.get_close_matches(name, choices, n=1)
    if close:
        msg += f" (did you mean {close[0]!r}?)"
    msg += f"; available: {', '.join(choices) if choices else 'none'}"
    if not close:
        msg += " (is the plugin that provides it installed? `rl plugins` lists what is loaded)"
    return msg


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r}; kinds are {', '.join(KINDS)}")
    return kind


def _qualname(obj: object) -> str:
    obj = obj.function if isinstance(obj, FunctionComponent) else obj
    o = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
    return f"{o.__module__}.{o.__qualname__}"


def _env_list(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def validate_plugin(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Reject hook implementations whose name or arguments do not match a spec, naming all three."""
    for attr in dir(plugin):
        if pm.parse_hookimpl_opts(plugin, attr) is None:
            continue
        caller = getattr(pm.hook, attr, None)
        if caller is None or caller.spec is None:
            close = difflib.get_close_matches(attr, _spec_names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PluginError(f"plugin {name!r} implements unknown hook {attr!r}{hint}")
        fn = getattr(plugin, attr)
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
        ]
        allowed = caller.spec.argnames
        for p in params:
            if p not in allowed:
                close = difflib.get_close_matches(p, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise PluginError(
                    f"plugin {name!r}, hook {attr!r}: argument {p!r} is not in the spec "
                    f"({', '.join(allowed)}){hint}"
                )


def _spec_names() -> list[str]:
    return [n for n, v in vars(hookspecs).items() if callable(v) and hasattr(v, f"{PROJECT}_spec")]


def _register(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    validate_plugin(pm, plugin, name)
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as e:
        raise PluginError(f"plugin {name!r} rejected: {e}") from e


#: The built-in plugins, registered first, by module name. A built-in component lives with its maths (the losses in
#: `rlx.train.losses`); `rlx.builtins` holds those that have no other home.
BUILTIN_PLUGINS = (
    "rlx.builtins.rewards",
    "rlx.builtins.generators",
    "rlx.builtins.agents",
    "rlx.train.advantages",
    "rlx.train.losses",
    "rlx.train.balance",
    "rlx.builtins.models",
    "rlx.transport.builtin",
    "rlx.builtins.loggers",
    "rlx.builtins.matmul",
)


#: Model families whose bridges ship as rlx's own model plugins: model_type -> (distribution, its folder).
FAMILY_PLUGINS = {
    "qwen3_moe": ("rlx-model-qwen", "plugins/models/qwen"),
    "qwen3_next": ("rlx-model-qwen", "plugins/models/qwen"),
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
                    ("rlx-model-qwen", "plugins/models/qwen")),
    "glm4_moe": ("rlx-model-glm", "plugins/models/glm"),
    "glm4_moe_lite": ("rlx-model-glm", "plugins/models/glm"),
    **dict.fromkeys(("deepseek_v3", "kimi_k2", "kimi_k25"), ("rlx-model-deepseek", "plugins/models/deepseek")),
    "minimax_m2": ("rlx-model-minimax", "plugins/models/minimax"),
}


_PROCESS: list[Plugins] = []  # `process_plugins`' manager, once built


def process_plugins() -> Plugins:
    """This process's plugin manager over the installed plugins, built on first use: one per process, shared by
    whatever needs the plugins and is not handed a manager (the CLI, a trainer rank, an engine, a model spec)."""
    if not _PROCESS:  # a broken plugin fails only the configs that name what it would provide (`unknown_message`)
        _PROCESS.append(build_plugins(keep_going=True))
    return _PROCESS[0]


def reset_process_plugins() -> None:
    """Forget `process_plugins`' manager (a new CLI invocation in the same process; a test's own)."""
    _PROCESS.clear()


def build_plugins(
    *,
    entry_points: bool = True,
    extra: Iterable[tuple[str, object]] = (),
    keep_going: bool = False,
) -> Plugins:
    """Build a fresh plugin manager and collect every component.

    :param entry_points: load third-party plugins from the ``rlx.plugins`` entry-point group.
    :param extra: ``(name, plugin)`` pairs registered after everything else (tests, embedding).
    :param keep_going: an entry-point plugin that fails to import, to register or to register its components is
        left out, with its error in its `PluginInfo` (``rl plugins``), instead of failing the whole build.
    """
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    disabled = _env_list("RLX_DISABLE_PLUGINS") or set()
    only = _env_list("RLX_LOAD_PLUGINS")
    version = _rlx_version()
    infos: list[PluginInfo] = []

    for modname in BUILTIN_PLUGINS:
        if modname in disabled:
            continue
        _register(pm, importlib.import_module(modname), modname)
        infos.append(PluginInfo(modname, "rlx", version))

    if entry_points:
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.name in disabled or (only is not None and ep.name not in only):
                continue
            dist = ep.dist.name if ep.dist else "?"
            dist_version = ep.dist.version if ep.dist else "?"
            if pm.has_plugin(ep.name):
                raise PluginError(
                    f"two plugins named {ep.name!r}: distribution {dist!r} and an earlier one; "
                    f"rename one entry point"
                )
            try:
                try:
                    plugin = ep.load()
                except Exception as e:
                    raise PluginError(
                        f"plugin {ep.name!r} from distribution {dist!r} failed to import "
                        f"({ep.value}): {type(e).__name__}: {e}"
                    ) from e
                _register(pm, plugin, ep.name)
            except PluginError as e:
                if not keep_going:
                    raise
                infos.append(PluginInfo(ep.name, dist, dist_version, error=str(e)))
                continue
            infos.append(PluginInfo(ep.name, dist, dist_version))

    for name, plugin in extra:
        _register(pm, plugin, name)
        module = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__module__
        infos.append(PluginInfo(name, module.split(".")[0], "-"))

    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        raise PluginError(str(e)) from e
    return Plugins(pm, infos, keep_going)


def _rlx_version() -> str:
    try:
        return md.version("rlx")
    except md.PackageNotFoundError:
        return "0+unknown"
