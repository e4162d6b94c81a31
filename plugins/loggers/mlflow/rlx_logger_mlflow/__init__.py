"""rlx logger plugin: MLflow tracking.

``run.loggers: [{name: mlflow, args: {tracking_uri: http://host:5000}}]`` logs the resolved config (artifact
``config.yaml``, plus the run's name, seed and model as tags), every numeric metric of every step, and every
``run.log_samples_interval`` steps the sample prompts, responses and rewards (``samples/step_NNNNNN.json``).
With no tracking URI (none given, no ``MLFLOW_TRACKING_URI``) it writes a file store at
``<output_dir>/mlruns``. A run resumed with ``rl train --resume`` continues the same MLflow run.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from rlx import hookimpl
from rlx.errors import RLXError
from rlx.hookspecs import RegisterLoggers

RUN_ID_FILE = "mlflow-run-id"
BATCH = 1000  # MLflow takes at most 1000 metrics per log_batch


class MlflowLogger:
    name = "mlflow"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else a file store <output_dir>/mlruns
        experiment: str = "rlx"  # created if missing
        run_name: str | None = None  # default: run.name
        tags: dict[str, str] = Field(default_factory=dict)

    def __init__(self, config: Config):
        self.config = config
        self.client: Any = None
        self.run_id: str | None = None

    def open(self, run) -> None:
        try:
            import yaml
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise RLXError("run.loggers: mlflow needs MLflow: pip install rlx-logger-mlflow") from None
        uri = self.config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a file store beside the run; MLflow 3 refuses file stores unless told otherwise
            uri = (Path(run.output_dir) / "mlruns").resolve().as_uri()
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        self.client = MlflowClient(tracking_uri=uri)
        id_file = Path(run.output_dir) / RUN_ID_FILE
        if run.resumed_from is not None and id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        exp = self.client.get_experiment_by_name(self.config.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(self.config.experiment)
        cfg = run.config
        tags = {"rlx.run.name": run.name, "rlx.run.seed": str(cfg.get("run", {}).get("seed")),
                "rlx.model.path": str(cfg.get("model", {}).get("path")), **self.config.tags}
        self.run_id = self.client.create_run(exp_id, run_name=self.config.run_name or run.name,
                                             tags=tags).info.run_id
        Path(run.output_dir).mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run_id)
        self.client.log_text(self.run_id, yaml.safe_dump(cfg, sort_keys=False), "config.yaml")

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, step) for k, v in metrics.items()
                if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)]
        for i in range(0, len(rows), BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i:i + BATCH])

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = [{"prompt": str(r.get("prompt")), "response": str(r.get("response")), "reward": r.get("reward")}
                 for r in rows]
        self.client.log_text(self.run_id, json.dumps(table, ensure_ascii=False, indent=1),
                             f"samples/step_{step:06d}.json")

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None


@hookimpl
def register_loggers(register: RegisterLoggers) -> None:
    register(MlflowLogger)


def read_run(output_dir: str | Path, tracking_uri: str | None = None) -> dict[str, Any]:
    """What the run logged from `output_dir` holds, read with MLflow's client: ``config`` (dict), ``history``
    ({step: {key: value}}) and ``tables`` ({step: rows}). For tests and quick checks."""
    import tempfile

    import yaml
    from mlflow.tracking import MlflowClient

    if tracking_uri is None:
        tracking_uri = (Path(output_dir) / "mlruns").resolve().as_uri()
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=tracking_uri)
    run_id = (Path(output_dir) / RUN_ID_FILE).read_text().strip()
    run = client.get_run(run_id)
    history: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run_id, key):
            history.setdefault(m.step, {})[key] = m.value
    tables = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", tmp)).read_text())
        for art in client.list_artifacts(run_id, "samples"):
            step = int(Path(art.path).stem.removeprefix("step_"))
            tables[step] = json.loads(Path(client.download_artifacts(run_id, art.path, tmp)).read_text())
    return {"config": config, "history": history, "tables": tables, "status": run.info.status}
