"""The built-in agent generator: any Python harness, trained through the adapter server.

``rollout.generator: {name: agent, args: {function: "package.module:agent"}}`` runs, for every sample,
``async def agent(base_url, api_key, task) -> float | None`` against an adapter server (OpenAI and
Anthropic APIs) that this generator starts on 127.0.0.1 in the rollout process. The api_key routes
the harness's requests to the sample's own session; ``task`` is a dict with the dataset row's
``prompt``, ``label``, ``metadata`` and the ``sample_id``. A returned float is the reward; None leaves
scoring to ``rollout.rewards`` (on the text the model wrote).

Every linear chain of the session becomes a sample: one for a plain multi-turn agent, several when
the harness forks (subagents, compaction), sharing the sample's trajectory. ``rollout.sampling.max_new_tokens``
is the policy's maximum output per call: a harness that asks for more, or sets no ``max_tokens``, gets that
many (real harnesses ask for tens of thousands). An agent that raises
fails its sample with the reason; one whose requests were aborted (a partial-rollout cut, an async
checkpoint) comes back ABORTED with no tokens, to run again from the start.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlx import hookimpl
from rlx.errors import RLXError
from rlx.hookspecs import RegisterGenerators
from rlx.protocols import Generation
from rlx.types import Sample, SampleStatus


class AgentArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    function: str  # "package.module:name", "path/to/file.py:name", or a registered agent's name
    agent_args: dict[str, Any] = Field(default_factory=dict)  # a registered agent's own Config
    parser: str = "auto"  # tool-call parser (rlx.agent.parsers); auto: by model family
    timeout_s: float = Field(600, gt=0)  # one agent run, end to end
    compare: bool = True  # record where a naive re-render would have disagreed with the token buffer


def load_function(spec: str, args: dict[str, Any] | None = None) -> Any:
    """The agent function from "module:name", "file.py:name", or the name of a registered agent (a class
    with ``name`` and ``async def run(self, base_url, api_key, task)``, from ``register_agents``), built with
    `args` (``rollout.generator.args.agent_args``, checked against the agent's ``Config``)."""
    if ":" not in spec:
        from rlx.config import ComponentSpec
        from rlx.plugins import process_plugins

        plugins = process_plugins()
        if spec not in plugins.names("agents"):
            known = ", ".join(plugins.names("agents")) or "none installed"
            raise RLXError(f"rollout.generator.args.function: {spec!r} is neither module:name, file.py:name nor "
                           f"a registered agent (registered: {known})")
        try:
            fn = getattr(plugins.build("agents", ComponentSpec(name=spec, args=dict(args or {}))), "run", None)
        except ValidationError as e:
            where = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise RLXError(f"rollout.generator.args.agent_args (agent {spec!r}): {where}") from None
    else:
        if args:
            raise RLXError(f"rollout.generator.args.agent_args: {spec!r} is a function, which takes no agent_args "
                           f"(only registered agents have a Config)")
        fn = _import(spec)
    if not asyncio.iscoroutinefunction(fn):
        raise RLXError(f"rollout.generator.args.function: {spec!r} must be an async function "
                       f"(async def agent(base_url, api_key, task))")
    return fn


def _import(spec: str) -> Any:
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where)
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or module_spec.loader is None or not path.exists():
                raise FileNotFoundError(where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        return getattr(module, name)
    except (ImportError, FileNotFoundError, AttributeError) as e:
        raise RLXError(f"rollout.generator.args.function: cannot load {spec!r}: {e}") from None


class AgentGenerator:
    name = "agent"
    Config = AgentArgs

    def __init__(self, config: AgentArgs):
        self.config = config
        self.fn = load_function(config.function, config.agent_args)
        self.adapter = None
        self._lock = asyncio.Lock()

    async def _adapter(self, ctx):
        async with self._lock:
            if self.adapter is None:
                from rlx.agent.server import AgentAdapter

                self.adapter = AgentAdapter(ctx, parser=self.config.parser, compare=self.config.compare)
                await self.adapter.start()
        return self.adapter

    async def generate(self, ctx: Generation, sample: Sample) -> list[Sample]:
        adapter = await self._adapter(ctx)
        # this call's context (training, or an evaluation dataset's sampling) and its maximum output per call
        session, key = adapter.open_session(f"sample-{sample.sample_id}-{id(sample):x}", ctx=ctx,
                                            max_output_tokens=ctx.sampling.max_new_tokens)
        task = {"prompt": sample.prompt_text, "label": sample.label, "metadata": dict(sample.metadata),
                "sample_id": sample.sample_id}
        try:
            async with asyncio.timeout(self.config.timeout_s):
                reward = await self.fn(adapter.base_url, key, task)
        except asyncio.TimeoutError:
            return [_failed(sample, f"agent {self.config.function} timed out after {self.config.timeout_s:.0f}s")]
        except Exception as e:
            return [_failed(sample, f"agent {self.config.function} raised {type(e).__name__}: {e}")]
        finally:
            adapter.close_session(session)
        out = session.samples(template=sample)
        if any(s.status == SampleStatus.ABORTED for s in out):
            sample.status = SampleStatus.ABORTED  # cannot resume a harness mid-way: run it again
            return [sample]
        if not out:
            return [_failed(sample, f"agent {self.config.function} made no model call")]
        out[0].sample_id = sample.sample_id
        mismatches = session.mismatch_counts()
        for s in out:
            s.metadata["agent_turns"] = len(session.turns)
            s.metadata["tito_mismatches"] = dict(mismatches)
            last = [t for t, m in zip(s.response_ids, s.loss_mask) if m]
            s.response_text = ctx.tokenizer.decode(last, skip_special_tokens=True)
            if reward is not None:
                s.reward = float(reward)
        return out


def _failed(sample: Sample, why: str) -> Sample:
    sample.status = SampleStatus.FAILED
    sample.error = why
    return sample


@hookimpl
def register_generators(register: RegisterGenerators) -> None:
    register(AgentGenerator)
