"""Experiment loggers: the built-in TensorBoard logger writes every step's metrics, the resolved config and
sample tables into event files that TensorBoard (here: its record format, read back) understands; the W&B
(offline) and MLflow (file store) plugins, selected beside it in the same run, record the same."""

import json
import math
import subprocess
import sys

import pytest
from rlx.testing.runs import read_events, small_run_config

pytestmark = pytest.mark.integration


def test_a_run_logs_every_metric_its_config_and_samples_to_every_logger(tiny_model_path, tmp_path):
    loggers = ["tensorboard", {"name": "wandb", "args": {"mode": "offline"}}, "mlflow"]
    cfg = small_run_config(tmp_path, "tb", run={"loggers": loggers, "log_samples_interval": 2},
                           ray={"enabled": False}, train={"num_steps": 3})
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    scalars: dict[str, list[tuple[int, float]]] = {}
    texts: dict[str, list[tuple[int, str]]] = {}
    for e in read_events(tmp_path / "tb" / "tensorboard"):
        for v in e.summary.value:
            if v.HasField("simple_value"):
                scalars.setdefault(v.tag, []).append((e.step, v.simple_value))
            else:
                texts.setdefault(v.tag, []).append((e.step, v.tensor.string_val[0].decode()))
    numeric = {k for row in rows for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numeric - set(scalars) == set(), "metrics missing from TensorBoard"
    for key in numeric:
        assert scalars[key] == [(row["step"], pytest.approx(row[key], rel=1e-6, abs=1e-6)) for row in rows
                                if isinstance(row.get(key), (int, float)) and not isinstance(row[key], bool)], key
    (step0, config), = texts["config/text_summary"]
    assert step0 == 0 and "output_dir:" in config and "loggers:" in config
    assert [step for step, _ in texts["samples/text_summary"]] == [1, 2]  # the first step, then every 2nd
    assert "| prompt | response | reward |" in texts["samples/text_summary"][0][1]

    # the plugins, read back with their trackers' own formats and clients
    from rlx_logger_mlflow import read_run
    from rlx_logger_wandb import read_offline_run

    def finite(row):
        return {k: float(v) for k, v in row.items() if isinstance(v, (int, float))
                and not isinstance(v, bool) and math.isfinite(v)}

    for name, got in (("wandb", read_offline_run(tmp_path / "tb")), ("mlflow", read_run(tmp_path / "tb"))):
        for row in rows:
            assert got["history"][row["step"]] == pytest.approx(finite(row), rel=1e-6, abs=1e-9), (name, row["step"])
        assert got["config"]["run"]["output_dir"] == str(tmp_path / "tb"), name
        assert sorted(got["tables"]) == [1, 2] and set(got["tables"][1][0]) == {"prompt", "response", "reward"}, name


def test_the_tracker_plugins_are_listed_by_rl_plugins():
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "plugins", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {p["name"]: p for p in json.loads(r.stdout)}
    assert rows["wandb"]["distribution"] == "rlx-logger-wandb" and rows["wandb"]["registers"] == {"loggers": ["wandb"]}
    assert rows["mlflow"]["distribution"] == "rlx-logger-mlflow" and rows["mlflow"]["registers"] == {"loggers": ["mlflow"]}
