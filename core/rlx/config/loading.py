"""Loading a config: one YAML file plus ``--set a.b=c`` overrides, validated all at once, every problem located.

* Every problem is collected before anything is reported: pydantic's own errors and `check_modes`, then the
  checks given (`rlx.preflight.config_checks`: component names against the installed plugins, each component's
  ``args`` against its own ``Config`` class, the files named). Each problem carries ``file:line: key.path``.
* ``--set`` values are parsed as YAML scalars (``--set rollout.sampling.temperature=0.7``); numeric
  path parts index lists (``--set rollout.rewards.0.weight=2``).
* File paths are made absolute relative to the config file, so workers in other folders never re-resolve them.
"""

from __future__ import annotations

import copy
import difflib
import os
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from rlx.config.modes import check_modes
from rlx.config.schema import MODEL_FIELDS, PATH_FIELDS, Config, Raw
from rlx.errors import ConfigError
from rlx.models.hub import is_hub_id


# A check beyond the schema (`rlx.preflight.config_checks`: the installed plugins, the files named): the problems
# it finds in a validated config, each (key path, message)
Check = Callable[["Config"], list[tuple[tuple[Any, ...], str]]]


def load_config(
    path: str | Path,
    overrides: list[str] = (),  # type: ignore[assignment]
    checks: Sequence[Check] = (),
) -> Config:
    """Read, override and validate a config; raise one `ConfigError` listing every problem. Then each of
    `checks` in turn (`rlx.preflight.config_checks`), each raising with all it found."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError([(str(path), f"cannot read: {e.strerror}")]) from None
    return parse_config(text, source=path, overrides=overrides, checks=checks)


def parse_config(
    text: str,
    source: Path | None = None,
    overrides: list[str] = (),  # type: ignore[assignment]
    checks: Sequence[Check] = (),
) -> Config:
    where = str(source) if source else "<config>"
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError([(f"{where}{line}", f"not valid YAML: {getattr(e, 'problem', e)}")]) from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError([(where, "the top level must be a mapping of sections")])
    lines = _line_map(node) if node is not None else {}

    problems: list[tuple[str, str]] = []
    overridden: dict[tuple[Any, ...], str] = {}
    for ov in overrides:
        try:
            keys = apply_override(data, ov)
            overridden[keys] = f"--set {ov}"
        except ValueError as e:
            problems.append((f"--set {ov}", str(e)))

    def locate(loc: tuple[Any, ...]) -> str:
        """Where `loc` was given: the --set that set it or a mapping above it (the nearest), else its line in the
        file, else a --set that set a key below it, else the nearest line above it."""
        above = [keys for keys in overridden if loc[:len(keys)] == keys]
        if above:
            return f"{overridden[max(above, key=len)]}: {format_path(loc)}"
        if loc in lines:
            return f"{where}:{lines[loc]}: {format_path(loc)}"
        below = [keys for keys in overridden if keys[:len(loc)] == loc]
        if below:
            return f"{overridden[below[0]]}: {format_path(loc)}"
        for n in range(len(loc) - 1, -1, -1):
            if loc[:n] in lines:
                return f"{where}:{lines[loc[:n]]}: {format_path(loc)}"
        return f"{where}: {format_path(loc)}"

    cfg: Config | None = None
    dropped: list[tuple[Any, ...]] = []
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = tuple(err["loc"])
            problems.append((locate(loc), describe_error(err, loc)))
        cfg, dropped = _without_refused(data, e)
    if cfg is not None:
        def check_problems(found: list[tuple[tuple[Any, ...], str]]) -> list[tuple[str, str]]:
            """The problems not about a value taken out (what a check says of its default would mislead)."""
            return [(locate(loc), msg) for loc, msg in found if not any(loc[:len(d)] == d for d in dropped)]

        if not dropped:  # (modes are checked across keys: one taken out would mislead them)
            problems += check_problems(check_modes(cfg))
        resolve_paths(cfg, source.resolve().parent if source else Path.cwd())
        for check in checks:  # all of them, so that one problem does not hide the next
            problems += check_problems(check(cfg))
    if problems:
        raise ConfigError(problems, source=where)
    assert cfg is not None
    return cfg


def _without_refused(data: dict[str, Any], error: ValidationError) -> tuple[Config | None, list[tuple[Any, ...]]]:
    """The config with each value the schema refused taken out (its default in its place), so that the checks
    past the schema (component names, files) run as well and every problem is reported at once; and the key paths
    taken out, whose checks would only see defaults. None where that does not validate (a required key is
    missing), or where a whole section was refused (a check across its keys would see only defaults)."""
    data = copy.deepcopy(data)
    dropped: list[tuple[Any, ...]] = []
    for _ in range(3):  # a value taken out may uncover a refusal further up (a list item's own type)
        removed = []
        for loc in (tuple(e["loc"]) for e in error.errors()):
            value = _remove(data, loc)
            if isinstance(value, dict):
                return None, dropped
            if value is not _ABSENT:
                removed.append(loc)
        if not removed:
            return None, dropped
        dropped += removed
        try:
            return Config.model_validate(data), dropped
        except ValidationError as e:
            error = e
    return None, dropped


_ABSENT = object()


def _remove(data: Raw, loc: tuple[Any, ...]) -> Raw:
    """Take the value at `loc` out of the raw tree; the value, or `_ABSENT` where there is none to take."""
    node = data
    for key in loc[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return _ABSENT
    if isinstance(node, dict) and loc and loc[-1] in node:
        return node.pop(loc[-1])
    return _ABSENT


def resolve_paths(cfg: Config, base: Path) -> None:
    """Make every file path in the tree absolute, relative to `base` (URLs such as builtin:// stay, and so does a
    model path ``org/name`` whose ``org`` is no folder there: a Hugging Face Hub id, `rlx.models.hub`)."""
    def resolve(value: str, model: bool) -> str:
        if "://" in value or (model and is_hub_id(value) and not (base / value).parent.exists()):
            return value
        return str((base / Path(value).expanduser()).resolve())

    for keys in PATH_FIELDS:
        node: Any = cfg
        for k in keys[:-1]:
            node = getattr(node, k)
        value = getattr(node, keys[-1])
        if value:
            setattr(node, keys[-1], resolve(value, keys in MODEL_FIELDS))
    for source in [*cfg.data.mix, *(a.data for a in (cfg.train.lora.adapters if cfg.train.lora else []))]:
        source.path = resolve(source.path, False)
    for d in cfg.eval.datasets:
        if "://" not in d.path:
            d.path = str((base / Path(d.path).expanduser()).resolve())
    for g in [*cfg.rollout.engines, *cfg.rollout.teachers]:
        if g.model_path:
            g.model_path = resolve(g.model_path, True)
        if g.speculative is not None and g.speculative.draft_model:
            g.speculative.draft_model = resolve(g.speculative.draft_model, True)
        if g.python and "/" in g.python:  # a bare name is looked up on PATH when the engine starts
            g.python = os.path.normpath(base.absolute() / Path(g.python).expanduser())  # a venv's python is a link


def apply_override(data: dict[str, Any], override: str) -> tuple[Any, ...]:
    """Apply ``a.b.c=value`` to the raw tree in place; return the key path."""
    if "=" not in override:
        raise ValueError("expected KEY.PATH=VALUE")
    dotted, raw = override.split("=", 1)
    parts: list[Any] = [int(p) if p.isdigit() else p for p in dotted.strip().split(".")]
    if not all(str(p) for p in parts):
        raise ValueError(f"empty part in key path {dotted!r}")
    value = yaml.safe_load(raw) if raw.strip() else ""
    node: Any = data
    for i, key in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            if not isinstance(key, int) or key >= len(node):
                raise ValueError(f"{format_path(parts[: i + 1])}: no list item {key}")
            if isinstance(node[key], str) and not isinstance(nxt, int):
                node[key] = {"name": node[key]}  # a component given by name alone
            node = node[key]
            continue
        if not isinstance(node, dict):
            raise ValueError(f"{format_path(parts[:i])} is not a mapping")
        if node.get(key) is None:
            node[key] = [] if isinstance(nxt, int) else {}
        elif isinstance(node[key], str) and not isinstance(nxt, int):
            node[key] = {"name": node[key]}
        node = node[key]
    last = parts[-1]
    if isinstance(node, list):
        if not isinstance(last, int) or last > len(node):
            raise ValueError(f"{format_path(parts)}: no list item {last}")
        node[last:last + 1] = [value]
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ValueError(f"{format_path(parts[:-1])} is not a mapping")
    return tuple(parts)


def format_path(loc: tuple[Any, ...] | list[Any]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<root>"


def describe_error(err: ErrorDetails, loc: tuple[Any, ...], known: list[str] | None = None) -> str:
    """One pydantic error as a sentence; `known`: the keys the mapping at ``loc[:-1]`` takes, where the config
    schema cannot tell them (a component's ``args``: its own ``Config``'s fields)."""
    kind = err["type"]
    if kind == "extra_forbidden":
        msg = "unknown key"
        known = _known_keys(loc[:-1]) if known is None else known
        if not known and loc[-2:-1] == ("args",):
            return msg + " (this component takes no args)"
        close = difflib.get_close_matches(str(loc[-1]), known, n=1) if known else []
        if close:
            msg += f" (did you mean {close[0]!r}?)"
        elif known:
            msg += f"; known keys: {', '.join(known)}"
        return msg
    if kind == "missing":
        return "required, but missing"
    return f"{err['msg']} (got {err.get('input')!r})"


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at `loc`, or [] if it cannot be told (e.g. a component's args)."""
    model: Any = Config
    for key in loc:
        if isinstance(key, int):
            continue
        fields = _fields_by_key(model)
        if not fields or key not in fields:
            return []
        model = _model_of(fields[key].annotation)
    return list(_fields_by_key(model))


def _fields_by_key(model: type[BaseModel] | None) -> dict[str, Any]:
    """A section's fields under the names YAML uses (the alias where there is one)."""
    return {f.alias or name: f for name, f in (getattr(model, "model_fields", None) or {}).items()}


def _model_of(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (list, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            m = _model_of(arg)
            if m is not None:
                return m
    return None


def _line_map(node: yaml.Node, prefix: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], int]:
    """Key path -> 1-based line of that key (or list item) in the YAML source."""
    out: dict[tuple[Any, ...], int] = {prefix: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            path = prefix + (k.value,)
            out.update(_line_map(v, path))
            out[path] = k.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out.update(_line_map(v, prefix + (i,)))
    return out
