"""Prompt datasets from JSONL, Parquet or a folder `datasets` saved, with a resumable shuffled cursor, and mixtures
of several.

Choices:

* Rows are checked when the file is read: each bad row (not JSON, not an object, a missing or
  mistyped prompt, sampling overrides SamplingConfig refuses) is reported as ``file:line: what`` and then skipped
  or fatal, as ``data.on_bad_row`` says. Parquet and `datasets` rows are numbered from 1 like lines.
* A `datasets` folder (``Dataset.save_to_disk``) is read with pyarrow, as the Arrow stream files its ``state.json``
  lists, so that reading one needs no `datasets` install. A ``DatasetDict`` folder holds one folder per split: the
  error names them.
* A row's ``metadata.sampling`` (an object of ``rollout.sampling`` keys) overrides the run's sampling for that
  row's samples (`rlx.rollout.context.for_sample`); the rest of its metadata reaches generators and rewards as is.
* A mixture (``data.mix``) draws each prompt's source at random by weight, from a generator seeded by ``run.seed``
  and the draw's number, and then the source's next row; each source keeps its own shuffled cursor. Its position
  is the number of draws and every source's cursor.
* The chat template is applied once per prompt, with the model's tokenizer, when the prompt is
  first drawn; ``prompt_ids`` are what the engine receives, never re-tokenized later.
* Order is a permutation of the rows seeded by ``run.seed`` and the epoch number, so the cursor
  ``(epoch, position)`` is all that a checkpoint needs to continue exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from rlx.config import Config, DataConfig, DataSource, LoRAAdapterConfig, SamplingConfig
from rlx.errors import RLXError

if TYPE_CHECKING:
    from rlx.types import JSON, Tokenizer

log = logging.getLogger(__name__)


@dataclass
class PromptRow:
    index: int  # position in the file (0-based; in a mixture, after the sources before it), stable across epochs
    line: int  # 1-based line (JSONL) or row number (Parquet, `datasets`), for messages
    prompt: str | None
    messages: list[dict[str, Any]] | None
    label: Any
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path = Path()  # the file it came from, for messages
    lora: str | None = None  # multi-LoRA: the adapter whose prompt it is (`AdapterDatasets`)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def tokenize_prompt(tokenizer: Tokenizer, row: PromptRow, chat: bool) -> list[int]:
    """The prompt's token ids, through the chat template when `chat` is set."""
    if chat:
        messages = row.messages if row.messages is not None else [{"role": "user", "content": row.prompt}]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    text = row.prompt if row.prompt is not None else "\n".join(m["content"] for m in row.messages or [])
    return tokenizer.encode(text, add_special_tokens=False)


MAX_SHOWN = 20  # bad rows listed in an error (the rest counted)


class PromptDataset:
    def __init__(self, cfg: DataConfig, path: Path, seed: int = 0):
        self.cfg = cfg
        self.path = Path(path)
        self.seed = seed
        self.skipped: list[str] = []
        self.bad: list[str] = []  # every bad row, "file:line: why"
        self.rows = self._read()
        if self.bad and cfg.on_bad_row == "error":
            shown = "\n    ".join(self.bad[:MAX_SHOWN])
            more = f"\n    ... and {len(self.bad) - MAX_SHOWN} more" if len(self.bad) > MAX_SHOWN else ""
            raise RLXError(f"{len(self.bad)} bad data row{'s' if len(self.bad) > 1 else ''} (set data.on_bad_row: "
                           f"skip to skip such rows):\n    {shown}{more}")
        if not self.rows:
            raise RLXError(f"{self.path}: no usable rows" + (f" ({len(self.skipped)} skipped)" if self.skipped else ""))
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    # -- reading ---------------------------------------------------------------------------------

    def _read(self) -> list[PromptRow]:
        if not self.path.exists():
            raise RLXError(f"{self.path} does not exist")
        if self.path.is_dir():
            raw = self._saved()
        elif self.path.suffix == ".parquet":
            raw = self._parquet()
        elif self.path.suffix in (".jsonl", ".json", ".ndjson"):
            raw = self._jsonl()
        else:
            raise RLXError(f"{self.path}: expected a .jsonl or .parquet file, or a folder `datasets` saved")
        rows: list[PromptRow] = []
        for line, obj in raw:
            try:
                rows.append(self._row(len(rows), line, obj))
            except ValueError as e:
                self._bad(line, str(e))
        return rows

    def _jsonl(self):
        with open(self.path, "rb") as f:
            for line, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    self._bad(line, f"not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})")
                    continue
                if not text.strip():
                    continue
                try:
                    yield line, json.loads(text)
                except json.JSONDecodeError as e:
                    self._bad(line, f"not valid JSON ({e.msg} at column {e.colno})")

    def _parquet(self):
        import pyarrow.parquet as pq

        for i, obj in enumerate(pq.read_table(self.path).to_pylist(), 1):
            yield i, obj

    def _saved(self):
        """The rows of a folder ``datasets.Dataset.save_to_disk`` wrote: Arrow stream files, listed in state.json."""
        import pyarrow as pa

        if (self.path / "dataset_dict.json").exists():
            splits = sorted(p.name for p in self.path.iterdir() if (p / "state.json").exists())
            raise RLXError(f"{self.path} holds a DatasetDict: name one split's folder, one of "
                           f"{', '.join(f'{self.path / s}' for s in splits)}")
        state = self.path / "state.json"
        if not state.exists():
            raise RLXError(f"{self.path}: a folder must be one `datasets` saved (save_to_disk), with a state.json")
        line = 0
        for f in json.loads(state.read_text())["_data_files"]:
            with pa.ipc.open_stream(self.path / f["filename"]) as reader:
                for obj in reader.read_all().to_pylist():
                    line += 1
                    yield line, obj

    def _row(self, index: int, line: int, obj: JSON) -> PromptRow:
        c = self.cfg
        if not isinstance(obj, dict):
            raise ValueError(f"expected an object, got {type(obj).__name__}")
        prompt = messages = None
        if c.messages_key is not None:
            messages = obj.get(c.messages_key)
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ) or not messages:
                raise ValueError(f"{c.messages_key!r} must be a non-empty list of {{role, content}} messages")
        else:
            prompt = obj.get(c.prompt_key)
            if not isinstance(prompt, str) or not prompt:
                got = "missing" if c.prompt_key not in obj else f"a {type(prompt).__name__}"
                raise ValueError(f"{c.prompt_key!r} must be a non-empty string, is {got}")
        meta = obj.get(c.metadata_key, {}) if c.metadata_key else {}
        if not isinstance(meta, dict):
            raise ValueError(f"{c.metadata_key!r} must be an object")
        if meta.get("sampling") is not None:
            try:
                SamplingConfig.model_validate(meta["sampling"])
            except ValidationError as e:
                errors = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'sampling'}: {x['msg']}" for x in e.errors())
                raise ValueError(f"{c.metadata_key}.sampling overrides rollout.sampling, and {errors}") from None
        return PromptRow(index, line, prompt, messages, obj.get(c.label_key), dict(meta), self.path)

    def _bad(self, line: int, why: str) -> None:
        where = f"{self.path}:{line}: {why}"
        if self.cfg.on_bad_row == "error":  # collected: every bad row is reported at once
            self.bad.append(where)
            return
        log.warning("skipping bad data row %s", where)
        self.skipped.append(where)

    # -- order -----------------------------------------------------------------------------------

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.cfg.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> PromptRow:
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        row = self.rows[self._order[self.position]]
        self.position += 1
        return row

    def __len__(self) -> int:
        return len(self.rows)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "epoch" not in state:
            raise RLXError("the checkpoint's data position is of a mixture of datasets (data.mix); this run reads one")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


class MixedDataset:
    """Several datasets (``data.mix``), each prompt drawn from one at random by weight; the same interface as
    `PromptDataset`."""

    what = "data.mix"  # (names it in errors)

    def __init__(self, cfg: DataConfig, seed: int = 0, sources: list[DataSource] | None = None):
        """`sources`: the datasets (default ``data.mix``), each read with `cfg`'s keys where it sets none."""
        self.seed = seed
        sources = cfg.mix if sources is None else sources
        # each source its own shuffle (a seed of its own), its rows numbered after the sources before it
        self.sources = [PromptDataset(cfg.reading(s), Path(s.path), seed + 1_000_003 * i) for i, s in enumerate(sources)]
        self.offsets = [sum(len(d) for d in self.sources[:i]) for i in range(len(self.sources))]
        self.weights = [s.weight for s in sources]
        self.path = f"{self.what} (" + ", ".join(str(d.path) for d in self.sources) + ")"
        self.draws = 0
        self.tags: list[str | None] = [None] * len(sources)  # what each source's rows carry as `PromptRow.lora`

    def pick(self) -> int:
        """The source of the next row: one at random by weight, from the seed and the draws so far alone."""
        u, total = random.Random(f"{self.seed}/mix/{self.draws}").random(), sum(self.weights)
        return next((k for k in range(len(self.weights)) if u < sum(self.weights[:k + 1]) / total), len(self.sources) - 1)

    def next(self) -> PromptRow:
        i = self.pick()
        self.draws += 1
        row = self.sources[i].next()
        return dataclasses.replace(row, index=self.offsets[i] + row.index, lora=self.tags[i])

    def __len__(self) -> int:
        return sum(len(d) for d in self.sources)

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws, "sources": [d.state_dict() for d in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sources" not in state or len(state["sources"]) != len(self.sources):
            raise RLXError(f"the checkpoint's data position is not of this mixture of {len(self.sources)} datasets "
                           f"({self.what} changed since it was saved)")
        self.draws = int(state["draws"])
        for d, s in zip(self.sources, state["sources"], strict=True):
            d.load_state_dict(s)


class AdapterDatasets(MixedDataset):
    """Multi-LoRA's prompts (``train.lora.adapters``): each adapter's own dataset, taken in turn by weight (smooth
    weighted round-robin: with weights 1 and 1, one of each alternately; with 2 and 1, two of the first per one of the
    second), each row marked with its adapter."""

    what = "train.lora.adapters"

    def __init__(self, cfg: DataConfig, adapters: list[LoRAAdapterConfig], seed: int = 0):
        super().__init__(cfg, seed, [a.data for a in adapters])
        self.tags = [a.name for a in adapters]
        self.credits = [0.0] * len(adapters)

    def pick(self) -> int:
        self.credits = [c + w for c, w in zip(self.credits, self.weights, strict=True)]
        i = max(range(len(self.credits)), key=lambda k: (self.credits[k], -k))
        self.credits[i] -= sum(self.weights)
        return i

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "adapters": self.tags, "credits": list(self.credits)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("adapters") != self.tags:
            raise RLXError(f"the checkpoint's data position is not of the adapters {self.tags} (train.lora.adapters "
                           f"changed since it was saved: {state.get('adapters')})")
        super().load_state_dict(state)
        self.credits = [float(c) for c in state["credits"]]


def open_dataset(cfg: Config, seed: int) -> PromptDataset | MixedDataset:
    """The run's prompts: ``data.path``, the mixture ``data.mix``, or each of ``train.lora.adapters``' own."""
    if cfg.train.lora is not None and cfg.train.lora.adapters:
        return AdapterDatasets(cfg.data, cfg.train.lora.adapters, seed)
    if cfg.data.mix:
        return MixedDataset(cfg.data, seed)
    if cfg.data.path is None:
        raise RLXError("a prompt file (or data.mix) is required")
    return PromptDataset(cfg.data, Path(cfg.data.path), seed)
