"""Built-in experiment logger: TensorBoard event files beside ``metrics.jsonl``.

``run.loggers: [tensorboard]`` writes ``<output_dir>/tensorboard/events.out.tfevents.*``: every numeric
metric of every step as a scalar (``pass@k`` spelled ``pass_at_k``, see `tag`), the resolved config as text at step 0, and every
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
from rlx.hookspecs import RegisterLoggers


def tag(key: str) -> str:
    """A metric's TensorBoard tag: TensorBoard allows letters, digits, ``_-./`` only and would turn
    ``eval/x/pass@4`` into ``pass_4``; ``@`` is spelled ``_at_`` instead (``eval/x/pass_at_4``)."""
    return key.replace("@", "_at_")


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
        import uuid

        # a suffix of its own: event files are named by the second they were opened in, and a run resumed
        # within the same second would otherwise overwrite the file it continues
        self.writer = SummaryWriter(logdir=str(run.output_dir / self.config.subdir),
                                    purge_step=None if run.resumed_from is None else run.resumed_from + 1,
                                    filename_suffix=f".{uuid.uuid4().hex[:8]}")
        self.writer.add_text("config", "```\n" + yaml.safe_dump(run.config, sort_keys=False) + "```", 0)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(tag(key), float(value), step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        def cell(v: object) -> str:
            return str(v).replace("|", "\\|").replace("\n", "<br>")

        table = "| prompt | response | reward |\n|---|---|---|\n" + "\n".join(
            f"| {cell(r.get('prompt'))} | {cell(r.get('response'))} | {cell(r.get('reward'))} |" for r in rows)
        self.writer.add_text("samples", table, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@hookimpl
def register_loggers(register: RegisterLoggers) -> None:
    register(TensorBoard)
