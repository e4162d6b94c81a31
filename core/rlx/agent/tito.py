"""Token-in-token-out sessions: the exact ids an agent's conversation was sampled from and as.

A harness sends the whole conversation every turn, as messages. Rendering those messages to tokens
again would re-encode what the model said, and the ids could differ from the ones it sampled. So a
session keeps, per linear chain of turns, one append-only buffer: the first prompt as rendered, then,
turn after turn, the engine's sampled ids (loss mask 1, with logprobs and weight versions) and the
rendered tokens of only the messages that arrived since (tool results, user turns: mask 0).

Each turn's messages are matched against every chain of the session, newest first:

* ``append``: the chain's known messages are a prefix of the request, exactly (text normalised).
* ``realign``: the same, except that the harness re-sent some assistant turn differently (stripped
  reasoning, reformatted tool-call arguments): the buffer keeps what the model really sampled.
* ``fork``: no chain matches (a subagent's own conversation, a compacted context, an edited history):
  a new chain starts from a fresh render. Each chain becomes one training sample; the chains of one
  trajectory share its reward and count once (`rlx.train.advantages.trajectories`).

The new messages' tokens come from the chat template itself: the conversation is rendered with a
placeholder assistant turn, with and without the new messages, and the difference is what the
template writes after an assistant turn (minus the stop token the engine already sampled) plus the new
messages and the generation prompt. A comparator then renders the whole request the naive way and
reports where it would have disagreed with the buffer, by kind: special tokens, non-assistant text,
assistant text. The counts are kept per session for debugging templates; training never uses them.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlx.rollout.context import append_env_tokens, append_model_tokens
from rlx.rollout.engines.client import GenerateResult
from rlx.types import Sample, SampleStatus

if TYPE_CHECKING:
    from rlx.types import Tokenizer

PLACEHOLDER = "\u2063rlx-assistant-turn\u2063"


class Renderer:
    """Chat-template rendering and tokenisation for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.eos_text = tokenizer.eos_token or ""
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def text(self, messages: list[dict], tools: list | None, generation: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation,
                                            tokenize=False)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def prompt(self, messages: list[dict], tools: list | None) -> list[int]:
        return self.encode(self.text(messages, tools, True))

    def delta(self, known: list[dict], new: list[dict], tools: list | None, ended_on_eos: bool) -> list[int] | None:
        """Tokens after an assistant turn that ends `known`: the template's close of that turn, the
        `new` messages and the generation prompt. None if the template is not prefix-stable here."""
        base = known[:-1] + [{"role": "assistant", "content": PLACEHOLDER}]
        before = self.text(base, tools, False)
        after = self.text(base + new, tools, True)
        if not after.startswith(before) or PLACEHOLDER not in before:
            return None
        close = before[before.rindex(PLACEHOLDER) + len(PLACEHOLDER):]
        if ended_on_eos and self.eos_text and close.startswith(self.eos_text):
            close = close[len(self.eos_text):]  # the engine sampled the stop token itself
        return self.encode(close + after[len(before):])


def normalise(m: dict[str, Any], *, assistant_text: bool = True) -> tuple:
    """What must match for a message to be 'the same' (roles, text, tool calls by name and arguments)."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", c)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                pass
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    text = (content or "").strip()
    if m.get("role") == "assistant" and not assistant_text:
        text = ""
    return m.get("role"), text, tuple(calls), m.get("tool_call_id")


@dataclass
class Chain:
    """One linear buffer: a prompt, then model and non-model tokens, append-only."""

    sample: Sample  # its prompt_ids, then response_ids with mask, logprobs and versions
    tools: list | None
    messages: list[dict] = field(default_factory=list)  # the conversation up to our last reply, inclusive
    ended_on_eos: bool = False

    @property
    def ids(self) -> list[int]:
        return self.sample.prompt_ids + self.sample.response_ids


@dataclass
class Turn:
    kind: str  # "start" | "append" | "realign" | "fork"
    chain: int
    new_tokens: int  # non-model tokens appended before generating
    sampled: int  # model tokens the engine returned
    mismatches: dict[str, int] = field(default_factory=dict)


class Session:
    """The chains and turns of one agent trajectory."""

    def __init__(self, session_id: str, renderer: Renderer, compare: bool = True):
        self.id = session_id
        self.r = renderer
        self.compare = compare
        self.chains: list[Chain] = []
        self.turns: list[Turn] = []
        self.ctx: Any = None  # the generation context of its calls (None: the adapter's)
        self.max_output_tokens: int | None = None  # the most one call generates (None: the adapter's)

    def prepare(self, messages: list[dict], tools: list | None) -> tuple[int, list[int], Turn]:
        """Choose or start the chain for this request; returns (chain index, input ids, the turn)."""
        for i in reversed(range(len(self.chains))):
            c = self.chains[i]
            kind = self._extends(c, messages, tools)
            if kind is None:
                continue
            new = messages[len(c.messages):]
            delta = self.r.delta(c.messages, new, tools, c.ended_on_eos)
            if delta is None:
                continue
            append_env_tokens(c.sample, delta)
            turn = Turn(kind, i, len(delta), 0)
            if self.compare:
                turn.mismatches = compare(self.r.prompt(messages, tools), c.ids, c.sample.loss_mask,
                                          len(c.sample.prompt_ids), self.r.special)
            c.messages = list(messages)
            return i, c.ids, turn
        ids = self.r.prompt(messages, tools)
        chain = Chain(Sample(prompt_ids=list(ids)), tools, list(messages))
        self.chains.append(chain)
        turn = Turn("start" if len(self.chains) == 1 else "fork", len(self.chains) - 1, 0, 0)
        return len(self.chains) - 1, list(ids), turn

    def _extends(self, c: Chain, messages: list[dict], tools: list | None) -> str | None:
        if (c.tools or None) != (tools or None) or len(messages) <= len(c.messages):
            return None
        head = messages[:len(c.messages)]
        if [normalise(m) for m in head] == [normalise(m) for m in c.messages]:
            return "append"
        if [normalise(m, assistant_text=False) for m in head] == [normalise(m, assistant_text=False)
                                                                   for m in c.messages]:
            return "realign"
        return None

    def record(self, chain: int, turn: Turn, res: GenerateResult, reply: dict[str, Any], eos_id: int | None) -> None:
        """Append the engine's sampled ids to the chain; `reply` is the assistant message as the harness
        will send it back."""
        c = self.chains[chain]
        append_model_tokens(c.sample, res)
        c.ended_on_eos = bool(res.output_ids) and eos_id is not None and res.output_ids[-1] == eos_id
        c.messages.append(reply)
        turn.sampled = len(res.output_ids)
        self.turns.append(turn)

    def samples(self, template: Sample | None = None) -> list[Sample]:
        """One training sample per chain that the model generated in; they share one trajectory.

        Each records how many tokens the engine sampled into it (``metadata["sampled_tokens"]``: the trainer
        checks it against the tokens it trains on), and the chain the last turn went to is marked
        ``metadata["final"]``: its text is the trajectory's answer.
        """
        out = []
        last = self.turns[-1].chain if self.turns else None
        for i, c in enumerate(self.chains):
            s = c.sample
            if not any(s.loss_mask):
                continue
            if template is not None:
                s.group_id, s.index, s.label = template.group_id, template.index, template.label
                s.prompt_text, s.metadata, s.lora = template.prompt_text, dict(template.metadata), template.lora
            s.metadata.pop("final", None)  # a regenerated sample's template may carry an earlier run's mark
            s.metadata["sampled_tokens"] = sum(t.sampled for t in self.turns if t.chain == i)
            if i == last:
                s.metadata["final"] = True
            if s.status not in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.ABORTED):
                s.status = SampleStatus.COMPLETED
            out.append(s)
        return out

    def mismatch_counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for t in self.turns:
            for k, v in t.mismatches.items():
                total[k] = total.get(k, 0) + v
        return total


def compare(rendered: list[int], buffer: list[int], mask: list[int], prompt_len: int,
            special: set[int]) -> dict[str, int]:
    """Where a naive re-render of the conversation disagrees with the buffer, counted per kind:
    ``special`` (a special token differs), ``assistant`` (inside what the model sampled), ``other``."""
    if rendered == buffer:
        return {}
    out: dict[str, int] = {}
    sm = difflib.SequenceMatcher(None, buffer, rendered, autojunk=False)
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op == "equal":
            continue
        for k in range(max(i2 - i1, j2 - j1)):
            b = buffer[i1 + k] if i1 + k < i2 else None
            r = rendered[j1 + k] if j1 + k < j2 else None
            if b in special or r in special:
                kind = "special"
            elif b is not None and i1 + k >= prompt_len and mask[i1 + k - prompt_len]:
                kind = "assistant"
            else:
                kind = "other"
            out[kind] = out.get(kind, 0) + 1
    return out
