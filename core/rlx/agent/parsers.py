"""Parsing what a model wrote into reasoning, text and tool calls, by model family.

A parser reads the decoded text of one assistant turn (the token ids stay what the engine sampled;
parsing never feeds back into training data). Parsers are registered by name; `parser_for` picks one
from the model's ``model_type`` unless config names one.

* ``hermes`` (Qwen2/Qwen3, Hermes and most ChatML models): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` blocks, reasoning in ``<think>...</think>``.
* ``none``: text only (reasoning still split off).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlx.errors import RLXError


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as both OpenAI and (parsed) Anthropic want it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def input(self) -> dict[str, Any]:
        try:
            value = json.loads(self.arguments or "{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {"value": value}


@dataclass
class Parsed:
    text: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


_THINK = re.compile(r"^\s*<think>(.*?)(?:</think>|$)", re.S)


def split_reasoning(text: str) -> tuple[str | None, str]:
    m = _THINK.match(text)
    if not m:
        return None, text
    return m.group(1).strip(), text[m.end():].lstrip("\n")


_PARSERS: dict[str, Callable[[str], Parsed]] = {}


def register_parser(name: str):
    def deco(fn: Callable[[str], Parsed]) -> Callable[[str], Parsed]:
        _PARSERS[name] = fn
        return fn

    return deco


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@register_parser("hermes")
def hermes(text: str) -> Parsed:
    reasoning, rest = split_reasoning(text)
    calls: list[ToolCall] = []
    for m in _TOOL_CALL.finditer(rest):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue  # not a call the model got right: leave it in the text
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", {})
            calls.append(ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args)))
    if calls:
        rest = _TOOL_CALL.sub("", rest)
    return Parsed(rest.strip() if calls else rest, reasoning, calls)


@register_parser("none")
def text_only(text: str) -> Parsed:
    reasoning, rest = split_reasoning(text)
    return Parsed(rest, reasoning)


FAMILIES = {"qwen2": "hermes", "qwen3": "hermes", "qwen2_moe": "hermes", "qwen3_moe": "hermes", "llama": "hermes",
            "mistral": "hermes", "glm4": "hermes"}


def parser_for(name: str, model_type: str | None = None) -> Callable[[str], Parsed]:
    """The parser called `name`, or for ``auto`` the one for the model family (``hermes`` by default)."""
    if name == "auto":
        name = FAMILIES.get(model_type or "", "hermes")
    if name not in _PARSERS:
        raise RLXError(f"agent parser {name!r} is unknown; known: {', '.join(sorted(_PARSERS))}")
    return _PARSERS[name]

