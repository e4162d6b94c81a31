"""A chaos run: faults at random steps of a deterministic run, which must end as if nothing had happened.

    scripts/loopback .venv/bin/python benchmarks/chaos.py                 # 100 steps, faults at random steps
    scripts/loopback .venv/bin/python benchmarks/chaos.py --seed 3        # another draw of steps

The quickstart (no evaluation) with two embedded engines, Ray, `run.deterministic`, a checkpoint every 10 steps and
`train.max_restarts: 1`, twice: once uninterrupted, and once while this harness, each at a step drawn at random (in a
random order), kills an engine (SIGKILL), freezes the other (SIGSTOP), kills the trainer rank (SIGKILL), and kills
the driver (SIGKILL) then resumes it with `--resume`. Printed: each fault and the step it came after, the samples
lost and the samples trained twice (each sample id must be trained once), and whether the final weights and each
step's training metrics equal the uninterrupted run's bit for bit. No peer publishes such a run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import yaml

from rlx.testing.processes import tagged_pids, wait_gone

ROOT = Path(__file__).parents[1]
# what a fault changes and nothing else: the machine's time, the engines' and trainers' own counts
NOT_COMPARED = ("time/", "cores/", "engines/", "trainer/restarts", "rollout/resent_requests")


def write_config(folder: Path, name: str, steps: int) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["run"].update(output_dir=str(folder / name), loggers=[], deterministic=True)
    doc["data"]["path"] = str(ROOT / "examples" / doc["data"]["path"])
    doc.pop("eval", None)
    doc["rollout"]["engines"] = [{"name": "main", "num_engines": 2, "server_args": {"num_threads": 1}}]
    doc["rollout"]["fault_tolerance"] = {"probe_interval_s": 0.5, "probe_timeout_s": 2, "failures": 2}
    doc["train"].update(num_steps=steps, max_restarts=1, checkpoint={"interval": 10})
    doc["ray"] = {"cpus_per_trainer": 0.5, "cpus_per_engine": 0.5}
    cfg = folder / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    return cfg


def start(cfg: Path, hf: Path, tag: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), "--save-hf", str(hf), *args],
                            env={**os.environ, "RLX_TEST_TAG": tag}, stdout=subprocess.DEVNULL,
                            stderr=open(cfg.with_suffix(".log"), "a"))


def last_step(metrics: Path) -> int:
    rows = metrics.read_text().splitlines() if metrics.exists() else []
    return json.loads(rows[-1])["step"] if rows else 0


def wait_for_step(p: subprocess.Popen, metrics: Path, step: int, log: Path) -> None:
    while last_step(metrics) < step:
        if p.poll() is not None:
            sys.exit(f"the run ended (exit {p.returncode}) before step {step}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def chaos_run(cfg: Path, hf: Path, faults: list[tuple[int, str]]) -> list[tuple[int, str, str]]:
    """Run `cfg` with `faults` ((after step, fault)) injected; what each hit."""
    tag = uuid.uuid4().hex
    metrics, log = cfg.parent / cfg.stem / "metrics.jsonl", cfg.with_suffix(".log")
    p = start(cfg, hf, tag)
    done = []
    for step, fault in faults:
        wait_for_step(p, metrics, step, log)
        if fault == "driver killed, then resumed":
            p.kill()
            p.wait()
            left = wait_gone(tag, timeout=60)
            if left:
                sys.exit(f"processes outlived the killed driver: {left}")
            p = start(cfg, hf, tag, "--resume")
            done.append((step, fault, f"pid {p.pid} resumed"))
            continue
        needle = b"TrainerWorker" if fault.startswith("trainer") else b"rlx.rollout.engines.embedded"
        while not (found := tagged_pids(tag, needle)):  # (an engine restarting: the one in its place)
            time.sleep(0.05)
        pid = found[0] if fault != "engine frozen" else found[-1]
        os.kill(pid, signal.SIGSTOP if fault == "engine frozen" else signal.SIGKILL)
        done.append((step, fault, f"pid {pid}"))
    if p.wait() != 0:
        sys.exit(f"the chaos run failed (exit {p.returncode}):\n{log.read_text()[-3000:]}")
    if wait_gone(tag, timeout=60):
        sys.exit("the chaos run left processes behind")
    return done


def read(folder: Path) -> tuple[list[dict], list[int], dict]:
    """Each step's compared metrics, the sample ids trained in order, and the last step's whole row."""
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    ids = [i for x in (folder / "samples.jsonl").read_text().splitlines() for i in json.loads(x)["sample_ids"]]
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in rows], ids, rows[-1]


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=None, help="draws the faults' steps and order (default: random)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1000)
    rng = random.Random(seed)
    kinds = ["engine killed", "engine frozen", "trainer rank killed", "driver killed, then resumed"]
    rng.shuffle(kinds)
    # apart enough that a restarted engine (about 10 s) is back before the next fault, and after the first checkpoint
    faults = list(zip(sorted(rng.sample(range(12, args.steps - 5, 12), len(kinds))), kinds, strict=True))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ref_cfg, cfg = write_config(folder, "uninterrupted", args.steps), write_config(folder, "chaos", args.steps)
        t0 = time.monotonic()
        ref = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(ref_cfg), "--save-hf",
                              str(folder / "hf-uninterrupted")], capture_output=True, text=True)
        if ref.returncode != 0:
            sys.exit(f"the uninterrupted run failed:\n{ref.stderr[-3000:]}")
        t1 = time.monotonic()
        done = chaos_run(cfg, folder / "hf-chaos", faults)
        t2 = time.monotonic()
        (want, want_ids, _), (got, got_ids, last) = read(folder / "uninterrupted"), read(folder / "chaos")
        a, b = weights(folder / "hf-uninterrupted"), weights(folder / "hf-chaos")
    counts = Counter(got_ids)
    lost, twice = set(want_ids) - set(got_ids), [i for i, n in counts.items() if n > 1]
    same_weights = a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a) if a.keys() == b.keys() else float("nan")
    print(f"examples/quickstart.yaml, {args.steps} steps, run.deterministic, two engines, Ray (fault draw --seed {seed})")
    print(f"uninterrupted run {t1 - t0:.0f} s, chaos run {t2 - t1:.0f} s")
    for step, fault, what in done:
        print(f"  after step {step:>3}: {fault} ({what})")
    print(f"  the run's own counts since its resume: engines taken out {last['engines/taken_out']:.0f}, restarted "
          f"{last['engines/restarts']:.0f}, back {last['engines/rejoined']:.0f}; trainer restarts "
          f"{last['trainer/restarts']:.0f}")
    print(f"samples trained: {len(got_ids)} of {len(want_ids)}; lost {len(lost)}, trained twice {len(twice)}")
    print(f"final weights vs the uninterrupted run: "
          f"{'equal, bit for bit' if same_weights else f'differ (max abs {diff:.3g})'}")
    print(f"training metrics of every step vs the uninterrupted run: {'equal' if got == want else 'DIFFER'}")


if __name__ == "__main__":
    main()
