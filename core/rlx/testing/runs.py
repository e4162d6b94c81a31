"""A small training run's config, for tests of plugins and of rlx itself: the tiny model on generated
arithmetic, a few steps on CPU, one engine. Sections given as keyword arguments are merged into the
defaults key by key, so a test states only what it is about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlx.tasks import arithmetic, write_jsonl


def small_run_config(folder: Path, name: str, *, seed: int = 1, **sections: dict[str, Any]) -> Path:
    """Write ``<folder>/<name>.yaml`` (output in ``<folder>/<name>``) and return its path."""
    folder = Path(folder)
    data = write_jsonl(arithmetic(40, seed=3), folder / "data.jsonl")
    doc: dict[str, Any] = {
        "run": {"output_dir": str(folder / name), "seed": seed},
        "model": {"path": "builtin://tiny-qwen3"},
        "data": {"path": str(data)},
        "rollout": {"n_prompts": 2, "n_samples_per_prompt": 2, "rewards": ["digits"],
                    "sampling": {"max_new_tokens": 8}, "engines": [{"server_args": {"num_threads": 1}}]},
        "train": {"num_steps": 3, "optim": {"lr": 1.0e-3}},
    }
    _merge(doc, sections)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def read_events(folder: Path) -> list[Any]:
    """Every event of the TensorBoard event files under `folder` (a run's ``tensorboard``), in file order: records
    of a length, its CRC, an ``Event`` proto and its CRC."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(Path(folder).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            events.append(Event.FromString(data[pos + 12:pos + 12 + n]))
            pos += 12 + n + 4
    return events


def train_and_export(folder: Path, model: str, steps: int = 3, *sets: str) -> dict[str, Any]:
    """`rl train` on `model` for `steps` steps (no Ray, every pushed tensor checked on the engine; `sets`: more
    ``--set`` overrides) with ``--save-hf``:
    its metrics rows, and the source's and the export's tensors by name (``rows``, ``before``, ``after``), for the
    checks every model family's run makes. Fails with the run's stderr if it fails."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from rlx.models.tiny import resolve_model_path
    from rlx.orchestrate.metrics import read

    cfg = small_run_config(folder, "run", model={"path": model}, ray={"enabled": False}, train={"num_steps": steps},
                           weight_sync={"verify": "full", "verify_full_interval": 1})
    run = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf", str(folder / "hf"),
                          *(a for s in sets for a in ("--set", s))],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]

    def tensors(where: str | Path) -> dict[str, Any]:
        return {k: v for f in sorted(Path(where).glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    return {"rows": read(folder / "run"), "before": tensors(resolve_model_path(str(model))),
            "after": tensors(folder / "hf")}


def sparse_engine_follows(rows: list[dict[str, Any]]) -> bool:
    """For a sparse-attention model's run (its metrics rows): the engine's log-probs are the trainer's (fp32) within
    1e-4 on most steps. A query whose k-th and (k+1)-th keys score within rounding of each other may keep another key
    in the engine (its rows and positions laid out otherwise than the trainer's packed rows), which moves a step's
    mean difference by up to ~1e-3."""
    diffs = sorted(r["train_rollout_logprob_diff"] for r in rows)
    return diffs[len(diffs) // 2] < 1e-4 and diffs[-1] < 1e-2


def decode(model: Any, tokenizer: Any, prompts: list[list[int]], params: Any, **scheduler: Any
           ) -> tuple[list[Any], Any, float]:
    """Every prompt through the embedded engine's scheduler (`rlx.rollout.engines.embedded.scheduler`, its thread,
    without HTTP) with `params` (a `SamplingParams`) and the scheduler's `scheduler` arguments: the finished
    requests in order, the stopped scheduler (its counters) and the seconds from the first submit to the last
    finish."""
    import threading
    import time

    from rlx.rollout.engines.embedded.scheduler import Request, Scheduler

    s = Scheduler(model, tokenizer, **scheduler)
    if s.mtp is not None:  # (the drafts' logits, for a test to compare: `mtp_draft_errors`)
        s.mtp.trace = []
    s.start()
    done = threading.Semaphore(0)
    reqs = [Request(list(p), params, on_done=lambda r: done.release()) for p in prompts]
    try:
        t = time.perf_counter()
        for r in reqs:
            s.submit(r)
        for _ in reqs:
            if not done.acquire(timeout=600):
                raise TimeoutError("the scheduler did not finish the requests in 10 minutes")
        return reqs, s, time.perf_counter() - t
    finally:
        s.shutdown()
