"""Correctness probes on real runs: at temperature 0.6 the trainer's log-probs are those the engine
sampled from, and full weight verification catches a difference that the sampled check cannot see."""

import asyncio
import json
import subprocess
import sys

import pytest

from rlx.testing.runs import small_run_config

pytestmark = pytest.mark.integration


def test_at_temperature_0_6_trainer_and_engine_log_probs_agree(tiny_model_path, tmp_path):
    cfg = small_run_config(tmp_path, "t06", ray={"enabled": False},
                           rollout={"sampling": {"temperature": 0.6, "max_new_tokens": 12}},
                           train={"num_steps": 2}, weight_sync={"verify": "full", "verify_full_interval": 1})
    r = subprocess.run([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "t06" / "metrics.jsonl").read_text().splitlines()]
    # at temperature 1 the difference is float noise (~1e-7); computing the trainer's at temperature 1 while the
    # engine samples at 0.6 made it ~0.09
    assert all(row["train_rollout_logprob_diff"] < 1e-4 for row in rows), [r["train_rollout_logprob_diff"] for r in rows]
    assert all(row["train_rollout_logprob_diff_frac"] == 0.0 for row in rows)
    assert rows[0]["rollout_logprobs_missing"] == 0.0


def test_full_verification_sees_what_a_sampled_check_cannot(tiny_model_path, tmp_path):
    from safetensors.torch import load_file

    from rlx.errors import RLXError
    from rlx.rollout.engines.fleet import Engine
    from rlx.rollout.engines.launch import HOST, ManagedProcess, embedded_command, free_port, wait_healthy
    from rlx.transport.verify import Fingerprints
    from rlx.transport.verify import served_dtypes, verify
    from rlx.transport.payloads import serialize_named_tensors

    state = load_file(f"{tiny_model_path}/model.safetensors")
    port = free_port()
    proc = ManagedProcess(embedded_command(tiny_model_path, port, server_args={"num_threads": 1}),
                          tmp_path / "engine.log")
    proc.start()
    engine = Engine(f"http://{HOST}:{port}", "target")

    async def push(named, version):
        async with engine.client() as c:
            await c.begin_weight_update()
            await c.update_weights_from_tensor([serialize_named_tensors(named)])
            await c.end_weight_update()
            await c.update_weight_version(str(version))

    async def run():
        await wait_healthy(engine.url, proc, 120)
        dtypes = await served_dtypes([engine])
        assert set(dtypes[engine.url].values()) == {"float32"} and set(state) <= set(dtypes[engine.url])
        new = {k: v + 0.5 for k, v in state.items()}
        prints = Fingerprints(plans=[dtypes[engine.url]], full=True)
        named = list(prints.watch(new.items()))
        await push(named, 1)
        await verify([engine], prints, 1, dtypes, full=True)  # every tensor's bytes match
        # one element far from the start of a tensor changes: the sampled check (first values) passes ...
        name = prints.sample_names()[1]
        bad = new[name].clone()
        bad.view(-1)[-1] += 1.0
        await push([(name, bad)], 1)
        await verify([engine], prints, 1, dtypes)
        # ... the full check does not
        with pytest.raises(RLXError, match=rf"serves 1 of {len(named)} checked tensors that differ .*{name}"):
            await verify([engine], prints, 1, dtypes, full=True)
        # and the sampled check sees a change among the first values
        bad.view(-1)[0] += 1.0
        await push([(name, bad)], 1)
        with pytest.raises(RLXError, match=rf"serves 1 of 3 checked tensors .*first 8 values.*{name}"):
            await verify([engine], prints, 1, dtypes)

    try:
        asyncio.run(run())
    finally:
        proc.stop()
