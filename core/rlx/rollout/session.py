"""Everything rollout needs for a run, built from config and torn down in reverse: tokenizer,
dataset, engines (launched or attached) with the router, generator context and manager.

`rl rollout` uses it alone; training uses it beside the trainer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.config import Config, adapter_pushes, launched_groups, records_routing
from rlx.data.datasets import open_dataset
from rlx.data.replay import batch_records
from rlx.errors import RLXError
from rlx.models.tiny import resolve_model_path
from rlx.rollout.context import GenerateContext, ServedAdapter
from rlx.rollout.engines.fleet import EngineFleet
from rlx.rollout.manager import RolloutManager
from rlx.rollout.teachers import Teachers

if TYPE_CHECKING:
    from rlx.plugins import Plugins


def load_tokenizer(cfg: Config) -> Any:
    from transformers import AutoTokenizer

    path = resolve_model_path(cfg.model.tokenizer or cfg.model.path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise RLXError(f"model.tokenizer: cannot load a tokenizer from {path}: {e}") from e


def vocab_size(model_path: str) -> int | None:
    """The model's embedding rows, from its config (None when it cannot be read: nothing is then checked)."""
    from rlx.models.tiny import model_config

    try:
        return int(model_config(model_path)["vocab_size"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def family_engine_args(model_path: str, plugins: Plugins) -> dict[str, Any]:
    """What the model's family needs from SGLang servers rlx launches: its bridge's ``engine_args`` (none
    when no installed bridge claims the model: generation alone needs no bridge)."""
    from rlx.train.spec import model_spec, read_model_type

    if not plugins.has_bridge(read_model_type(model_path)):
        return {}
    return model_spec(model_path, plugins).engine_args()


def request_adapters(cfg: Config) -> dict[str, Any]:
    """`GenerateContext`'s LoRA adapters that requests name (``train.lora.push: adapter``): the one adapter, or with
    several (``train.lora.adapters``) each by its name, for its samples' requests (`for_sample`; the base model for
    the rest)."""
    if not adapter_pushes(cfg) or cfg.train.lora is None:
        return {}
    if not cfg.train.lora.adapters:
        return {"adapter": ServedAdapter(on=True)}
    return {"adapters": {name: ServedAdapter(on=True) for name in cfg.train.lora.names if name is not None}}


class RolloutSession:
    def __init__(self, cfg: Config, plugins: Plugins, spawn=None, with_data: bool = True):
        """`spawn`: how engine processes start (see `EngineFleet`); default local processes.
        `with_data`: build the dataset and the rollout manager (`rl serve` needs only the engines)."""
        self.cfg = cfg
        self.plugins = plugins
        self.with_data = with_data
        self.output_dir = Path(cfg.run.output_dir)
        engine_args = functools.partial(family_engine_args, plugins=plugins)
        here = sum(g.num_engines for g in launched_groups(cfg))
        self.fleet = EngineFleet(cfg, self.output_dir / "logs", spawn, engine_args=engine_args, engines_here=here)
        self.teachers = Teachers(cfg, spawn, engine_args, here)  # on-policy distillation's (rollout.teachers)
        self._ctx: GenerateContext | None = None
        self._manager: RolloutManager | None = None

    @property
    def ctx(self) -> GenerateContext:
        """Generation through the engines (from entry on)."""
        if self._ctx is None:
            raise RLXError("the rollout session has not started: use it inside `async with`")
        return self._ctx

    @property
    def manager(self) -> RolloutManager:
        """The rollout manager (from entry on, when the session has data)."""
        if self._manager is None:
            raise RLXError("the rollout session has no rollout manager: it has not started, or has no data")
        return self._manager

    async def __aenter__(self) -> RolloutSession:
        tokenizer = load_tokenizer(self.cfg)
        dataset = None
        if self.with_data:
            try:
                dataset = open_dataset(self.cfg, self.cfg.run.seed)
            except RLXError as e:
                where = ("train.lora.adapters" if self.cfg.train.lora is not None and self.cfg.train.lora.adapters
                         else f"data.{'mix' if self.cfg.data.mix else 'path'}")
                raise RLXError(f"{where}: {e}") from None
        await self.fleet.start()
        try:
            return await self._enter(tokenizer, dataset)
        except BaseException:
            await self.__aexit__()
            raise

    async def _enter(self, tokenizer: Any, dataset: Any) -> RolloutSession:
        if self.with_data:
            await self.teachers.start()
        if not self.fleet.engines:  # rollout.source: replay: nothing generates
            return self
        ctx = self._ctx = GenerateContext(
            self.fleet.client(), tokenizer, self.cfg.rollout.sampling, self.cfg.rollout.requests.retries,
            health=self.fleet.health, routed_experts=records_routing(self.cfg), coalesce=self.cfg.rollout.coalesces,
            vocab_size=vocab_size(self.cfg.model.path), seed=self.cfg.run.seed if self.cfg.run.deterministic else None,
            **request_adapters(self.cfg))
        ctx.context_length = await self.fleet.context_length()
        if dataset is not None:
            self._manager = RolloutManager(self.cfg, self.plugins, dataset, ctx, abort_all=self.abort_all,
                                           teachers=self.teachers)
        return self

    async def abort_all(self) -> None:
        await self.fleet.for_each(lambda c: c.abort())

    async def __aexit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            await self._ctx.client.close()
        await self.teachers.stop()
        await self.fleet.stop()


async def rollout_only(cfg: Config, plugins: Plugins, out_path: Path | None = None, progress=None) -> Path:
    """Run ``rollout.num_steps`` rollout steps with no training and write the groups as JSONL."""
    async with RolloutSession(cfg, plugins) as session:
        out = out_path or (Path(cfg.rollout.output) if cfg.rollout.output
                           else session.output_dir / "rollout.jsonl")
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            for step in range(1, cfg.rollout.num_steps + 1):
                batch = await session.manager.next_batch(step)
                plugins.on_rollout_end(batch)
                for rec in batch_records(batch):
                    f.write(json.dumps(rec) + "\n")
                f.flush()
                if progress is not None:
                    progress(step, batch)
    return out
