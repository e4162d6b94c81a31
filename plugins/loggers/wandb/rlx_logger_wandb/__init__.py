"""rlx logger plugin: Weights & Biases.

``run.loggers: [{name: wandb, args: {project: my-project}}]`` logs the resolved config, every numeric metric
of every step, and every ``run.log_samples_interval`` steps a table of prompts, responses and rewards.
``mode: offline`` writes the run under ``<output_dir>/wandb`` to upload later with ``wandb sync``. A run
resumed with ``rl train --resume`` continues the same W&B run (its id is kept in ``<output_dir>/wandb-run-id``).
"""

from __future__ import annotations

import math
import numbers
import struct
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from rlx import hookimpl
from rlx.errors import RLXError
from rlx.hookspecs import RegisterLoggers

RUN_ID_FILE = "wandb-run-id"


class WandbLogger:
    name = "wandb"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        project: str = "rlx"
        entity: str | None = None  # your W&B user or team (default: the API key's)
        mode: Literal["online", "offline", "disabled"] = "online"  # offline: sync later with `wandb sync`
        name: str | None = None  # the W&B run name (default: run.name)
        group: str | None = None
        tags: list[str] = Field(default_factory=list)
        dir: str | None = None  # where W&B writes its files (default: the run's output folder)

    def __init__(self, config: Config):
        self.config = config
        self.run: Any = None

    def open(self, run) -> None:
        try:
            import wandb
        except ImportError:
            raise RLXError("run.loggers: wandb needs the wandb package: pip install rlx-logger-wandb") from None
        id_file = Path(run.output_dir) / RUN_ID_FILE
        run_id = id_file.read_text().strip() if run.resumed_from is not None and id_file.is_file() else None
        folder = Path(self.config.dir) if self.config.dir else Path(run.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.config.project, entity=self.config.entity, mode=self.config.mode,
                              name=self.config.name or run.name, group=self.config.group, tags=self.config.tags,
                              dir=str(folder), config=run.config, id=run_id,
                              resume="allow" if run_id else None, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))
        id_file.write_text(self.run.id)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        numeric = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)}
        self.run.log(numeric, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        table = wandb.Table(columns=["prompt", "response", "reward"],
                            data=[[str(r.get("prompt")), str(r.get("response")), r.get("reward")] for r in rows])
        self.run.log({"sample_table": table}, step=step)  # "samples" is a metric (samples trained on)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


@hookimpl
def register_loggers(register: RegisterLoggers) -> None:
    register(WandbLogger)


# -- reading an offline run back ---------------------------------------------------------------------------

def read_offline_run(folder: str | Path, timeout_s: float = 60.0) -> dict[str, Any]:
    """What an offline W&B run under `folder` (the ``dir`` given to W&B) holds: ``config`` (dict),
    ``history`` ({step: {key: value}}) and ``tables`` ({step: rows}), decoded from its ``run-*.wandb`` file(s)
    with W&B's own protobuf types. For tests and quick checks; ``wandb sync`` uploads the same files.

    W&B's service writes the file after ``run.finish()`` returns (measured: a 7-byte file just after finish
    under load, complete a moment later), so each file is read once it holds its run's exit record, waiting
    up to `timeout_s`."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(folder).glob("wandb/offline-run-*/run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no offline W&B run under {folder}/wandb")
    out: dict[str, Any] = {"config": {}, "history": {}, "tables": {}}
    for path in files:
        for rec in _finished_records(path, pb, timeout_s):
            kind = rec.WhichOneof("record_type")
            if kind in ("config", "run"):  # the config comes with the run record, updates after it
                for item in (rec.config if kind == "config" else rec.run.config).update:
                    if not item.key.startswith("_"):
                        out["config"][item.key] = json.loads(item.value_json)
            elif kind == "history":
                row: dict[str, Any] = {}
                for item in rec.history.item:  # media (a table) come as fields under nested keys
                    value = json.loads(item.value_json)
                    if item.key:
                        row[item.key] = value
                    else:
                        *parents, last = item.nested_key
                        node = row
                        for p in parents:
                            node = node.setdefault(p, {})
                        node[last] = value
                step = int(row.pop("_step", rec.history.step.num))
                for key, value in row.items():
                    if isinstance(value, dict) and value.get("_type") == "table-file":
                        table = json.loads((path.parent / "files" / value["path"]).read_text())
                        out["tables"][step] = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
                    elif not key.startswith("_"):
                        out["history"].setdefault(step, {})[key] = value
    return out


def _finished_records(path: Path, pb, timeout_s: float) -> list[Any]:
    """The records of the run log at `path` once it ends with the run's exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        data = path.read_bytes()
        try:  # a file still being written may end in a partial record
            records = [pb.Record.FromString(d) for d in _log_records(data)] if len(data) >= 7 else []
        except Exception:  # noqa: BLE001 - protobuf's DecodeError, or a header cut short
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: no exit record after {timeout_s:.0f} s ({len(records)} records): "
                               f"the run did not finish, or W&B's service has not written it yet")
        time.sleep(0.05)


def _log_records(data: bytes):
    """The records of a W&B transaction log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks
    of chunks, each a 7-byte header (CRC-32C, length, type: 1 full, 2 first, 3 middle, 4 last) and data."""
    if data[:4] != b":W&B":
        raise ValueError("not a W&B transaction log")
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
        elif kind == 0 and length == 0:
            pos += block - pos % block if pos % block else 0
