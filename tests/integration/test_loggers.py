"""Experiment loggers: the built-in TensorBoard logger writes every step's metrics, the resolved config and
sample tables into event files that TensorBoard (here: its record format, read back) understands."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration


def read_events(folder: Path) -> list:
    """Every event of the TensorBoard files under `folder` (length-prefixed records of `Event` protos)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            events.append(Event.FromString(data[pos + 12:pos + 12 + n]))
            pos += 12 + n + 4  # length, its crc, the record, its crc
    return events


def test_a_run_logs_every_metric_its_config_and_samples_to_tensorboard(tiny_model_path, tmp_path):
    cfg = small_run_config(tmp_path, "tb", run={"loggers": ["tensorboard"], "log_samples_interval": 2},
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
