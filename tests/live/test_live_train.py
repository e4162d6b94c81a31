"""`rl train` through live SGLang 0.5.23 servers on the CPU: the quickstart learns as it does through the embedded
engine; every weight transport SGLang can receive here leaves SGLang serving exactly the trainer's weights, by
SGLang's own checksum; a server killed or frozen mid-run is taken out, restarted or waited for, and no sample
is lost or trained twice."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlx.rollout.engines.client import EngineClient
from rlx.testing.processes import processes_tagged, wait_gone
from rlx.testing.runs import small_run_config

pytestmark = [pytest.mark.integration, pytest.mark.live]

ROOT = Path(__file__).resolve().parents[2]


def rl_train(cfg: Path, *args: str, tag: str | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    tag = tag or uuid.uuid4().hex
    env = {**os.environ, "RLX_TEST_TAG": tag}
    p = subprocess.Popen([sys.executable, "-m", "rlx_cli.main", "train", str(cfg), *args], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert wait_gone(tag) == [], "rl train left processes behind"
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_quickstart_learns_through_live_sglang(sglang_py, tiny_model_path, tmp_path):
    out = tmp_path / "run"
    r = rl_train(ROOT / "examples" / "quickstart.yaml", "--set", f"run.output_dir={out}",
                 "--set", "rollout.engines.0.backend=sglang", "--set", f"rollout.engines.0.python={sglang_py}",
                 "--set", "eval.interval=60")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(out)
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    diff = max(r["train_rollout_logprob_diff"] for r in rows)
    greedy = [e["pass@1"] for e in map(json.loads, (out / "eval.jsonl").read_text().splitlines())
              if e["dataset"] == "heldout"]
    print(f"quickstart through live SGLang: reward {first:.3f} -> {last:.3f}, held-out greedy pass@1 "
          f"{greedy[0]:.3f} -> {greedy[-1]:.3f}, {sum(r['time/step_s'] for r in rows) / len(rows):.2f} s/step, "
          f"largest log-prob diff {diff:.2e}")
    # through the embedded engine: 0.15 -> 0.40-0.53 on an AMD EPYC, 0.30 -> 0.375-0.425 on an Intel Xeon (the warm
    # model's seconds of training are not bitwise the same on every CPU); through SGLang 0.30 -> 0.40 on the Xeon
    # a run whose weights never reached SGLang answers the held-out prompts at step 60 exactly as at step 0.
    # The training reward is printed, not compared: sampled at temperature 1 on 8 new prompts a step, it stays
    # near 0.3 while the held-out answers improve (one CI run: first five steps 0.313, last five 0.297, with
    # greedy held-out 0.30 -> 0.425), so which five steps score higher is chance
    assert len(greedy) == 2 and greedy[-1] > greedy[0]
    assert diff < 1e-3  # fp32 on both sides


@pytest.fixture
def attached(sglang_server):
    """The tier's live SGLang server, started by hand as a user would (tests/live/conftest.py), for runs that attach
    to it by address."""
    return sglang_server


def checksum(url: str, load: Path | None = None) -> str:
    async def run():
        async with EngineClient(url, timeout_s=300) as c:
            if load is not None:
                await c.update_weights_from_disk(str(load))
            return (await c.weights_checker())["per_engine_checksum"]

    return asyncio.run(run())


@pytest.mark.parametrize("transport", ["disk", "tensor", "broadcast", "delta"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_transport_leaves_sglang_serving_the_trainers_weights(attached, transport, mode, tiny_model_path,
                                                                    tmp_path):
    """8 steps, a push after each, into a server rlx attached to; then SGLang's checksum of what it serves
    equals its checksum of the trainer's exported weights loaded from disk: bit for bit, in SGLang's own
    (fused) layout."""
    cfg = small_run_config(tmp_path, "run", rollout={"external_engines": [attached]},
                           train={"num_steps": 8, "mode": mode, "checkpoint": {"interval": 0}},
                           weight_sync={"transport": transport})
    r = rl_train(cfg, "--save-hf", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [x["weight_version"] for x in rows][-1] == 8
    served = checksum(attached)
    assert checksum(attached, load=tmp_path / "hf") == served
    assert checksum(attached, load=Path(tiny_model_path)) != served  # the pushes changed it (and it starts over)


def test_a_killed_and_a_frozen_server_loses_no_sample(sglang_py, tmp_path):
    """Two groups of one launched SGLang server each, behind sglang-router; one server is killed (-9) after the
    first step, then the other frozen (SIGSTOP) until it is taken out: the run completes every step with every
    sample id once."""
    steps = 30
    cfg = small_run_config(
        tmp_path, "run", seed=5,
        rollout={"n_prompts": 3, "sampling": {"max_new_tokens": 24, "ignore_eos": True},
                 "engines": [{"name": "a", "backend": "sglang", "python": sglang_py},  # a topology of two groups
                             {"name": "b", "backend": "sglang", "python": sglang_py}],
                 "router": {"policy": "round_robin"},
                 "fault_tolerance": {"probe_interval_s": 0.5, "probe_timeout_s": 2, "failures": 2}},
        train={"num_steps": steps, "checkpoint": {"interval": 0}},
        ray={"cpus_per_trainer": 0.5, "cpus_per_engine": 0.5})
    tag = uuid.uuid4().hex
    p = subprocess.Popen([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)],
                         env={**os.environ, "RLX_TEST_TAG": tag}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    run = tmp_path / "run"
    frozen: list[int] = []
    try:
        def servers() -> list[int]:
            out = []
            for pid in processes_tagged(tag):
                try:
                    if b"sglang.launch_server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        out.append(pid)
                except OSError:
                    pass
            return sorted(out)

        def wait_for(cond, what, limit=600):
            deadline = time.monotonic() + limit
            while not cond():
                assert p.poll() is None, p.stderr.read()[-3000:]
                assert time.monotonic() < deadline, what
                time.sleep(0.1)

        wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip(),
                 "no first step")
        first = servers()
        os.kill(first[0], signal.SIGKILL)
        wait_for(lambda: any(r.get("engines/restarts", 0) for r in metrics(run)), "the killed server never came back")
        os.kill(first[1], signal.SIGSTOP)
        frozen.append(first[1])
        wait_for(lambda: any(r.get("engines/taken_out", 0) >= 2 for r in metrics(run)) or p.poll() is not None,
                 "the frozen server was never taken out")
        _, err = p.communicate(timeout=900)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err[-3000:]
    assert wait_gone(tag) == [], "rl train left processes behind"
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    last = rows[-1]
    print(f"live SGLang faults: taken out {last['engines/taken_out']}, restarted {last['engines/restarts']}, "
          f"back {last['engines/rejoined']}, requests sent again {sum(r['rollout/resent_requests'] for r in rows)}")
    assert last["engines/taken_out"] == 2 and last["engines/restarts"] >= 1
    trained = [i for line in (run / "samples.jsonl").read_text().splitlines() for i in json.loads(line)["sample_ids"]]
    assert len(trained) == len(set(trained)) == steps * 3 * 2


def test_a_student_distils_from_a_teacher_served_by_live_sglang(sglang_py, tmp_path):
    """`examples/distill.yaml` with its teacher launched as a live SGLang server (the student on the embedded engine)
    and the top-k estimator: rlx starts SGLang as a teacher group, SGLang scores every sample of every step (prompt
    log-probs from logprob_start_len, top-k with top_logprobs_num) and the objective trains on them. Whether the KL
    falls is not compared here: over 20 steps it moves either way with the samples drawn (2.88 -> 2.83, 3.30 -> 3.44
    top-k KL in two runs); that scores are SGLang's to the value is test_live_differential's, and what distillation
    learns over 60 steps benchmarks/distill.py's."""
    out = tmp_path / "run"
    r = rl_train(ROOT / "examples" / "distill.yaml", "--set", f"run.output_dir={out}", "--set", "train.num_steps=20",
                 "--set", "rollout.teachers.0.backend=sglang", "--set", f"rollout.teachers.0.python={sglang_py}",
                 "--set", "train.objective.distill.estimator=top_k", "--set", "eval.datasets=[]",
                 "--set", "train.checkpoint.interval=0")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(out)
    kl = [row["distill/arith/reverse_kl"] for row in rows]
    topk = [row["distill_topk_kl"] for row in rows]
    print(f"distilling from live SGLang (top_k): reverse KL per token {sum(kl[:5]) / 5:.3f} -> {sum(kl[-5:]) / 5:.3f}, "
          f"top-k KL {sum(topk[:5]) / 5:.3f} -> {sum(topk[-5:]) / 5:.3f}")
    assert len(kl) == 20 and all(0 < k < 20 for k in kl) and all(0 < k < 20 for k in topk)
    logs = [f.read_text(errors="replace") for f in (out / "logs" / "teacher-arith").rglob("*.log")]
    assert logs and all("sglang" in text.lower() for text in logs)  # the teacher was SGLang's server
