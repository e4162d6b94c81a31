"""Built-in experiment logger: TensorBoard event files beside ``metrics.jsonl``.

``run.loggers: [tensorboard]`` writes ``<output_dir>/tensorboard/events.out.tfevents.*``: every numeric
metric of every step as a scalar, the resolved config as text at step 0, and every
``run.log_samples_interval`` steps a table of sample prompts, responses and rewards. Written with
tensorboardX (numpy and protobuf only), so it needs neither TensorFlow nor a TensorBoard install;
``tensorboard --logdir <output_dir>/tensorboard`` shows it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from pydantic import BaseModel, ConfigDict

from rlx import hookimpl
from rlx.errors import RLXError


class TensorBoard:
    name = "tensorboard"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        subdir: str = "tensorboard"  # under the run's output folder

    def __init__(self, config: Config):
        self.config = config
        self.writer: Any = None

    def open(self, run) -> None:
        import yaml

        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise RLXError("run.loggers: tensorboard needs tensorboardX: pip install 'rlx[train]'") from None
        self.writer = SummaryWriter(logdir=str(run.output_dir / self.config.subdir),
                                    purge_step=None if run.resumed_from is None else run.resumed_from + 1)
        self.writer.add_text("config", "```\n" + yaml.safe_dump(run.config, sort_keys=False) + "```", 0)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        def cell(v: Any) -> str:
            return str(v).replace("|", "\\|").replace("\n", "<br>")

        table = "| prompt | response | reward |\n|---|---|---|\n" + "\n".join(
            f"| {cell(r.get('prompt'))} | {cell(r.get('response'))} | {cell(r.get('reward'))} |" for r in rows)
        self.writer.add_text("samples", table, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@hookimpl
def register_loggers(register):
    register(TensorBoard)
