"""What the benchmarks that train on an example config share: the config as a benchmark runs it, `rl train` on it,
and the run's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[1]


def example(folder: Path, name: str, example: str, *, steps: int, seed: int | None = None,
            evals: tuple[str, ...] | None = ("heldout",)) -> dict[str, Any]:
    """examples/`example` with its output in `folder`/`name`, no loggers, no checkpoints, `steps` steps, its paths
    absolute, and of its eval datasets those named in `evals` (None: no evaluation), evaluated at the start and at
    the end."""
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    doc["run"].update(output_dir=str(folder / name), loggers=[], **({"seed": seed} if seed is not None else {}))
    for data in [doc["data"], *(a["data"] for a in doc["train"].get("lora", {}).get("adapters", []))]:
        if "path" in data:
            data["path"] = str(ROOT / "examples" / data["path"])
    if evals is None:
        doc.pop("eval", None)
    else:
        doc["eval"]["datasets"] = [d for d in doc["eval"]["datasets"] if d["name"] in evals]
        for d in doc["eval"]["datasets"]:
            d["path"] = str(ROOT / "examples" / d["path"])
        doc["eval"]["interval"] = steps
    doc["train"].update(num_steps=steps, checkpoint={"interval": 0})
    return doc


def train(folder: Path, name: str, doc: dict[str, Any]) -> str:
    """`rl train` on `doc` (written as `folder`/`name`.yaml); its stderr. A failed run ends the benchmark."""
    cfg = folder / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
    return r.stderr


def rows(folder: Path, name: str, file: str = "metrics.jsonl") -> list[dict[str, Any]]:
    return [json.loads(x) for x in (folder / name / file).read_text().splitlines()]
