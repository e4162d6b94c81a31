"""The rollout buffer service: validation with reasons, exact tokens, messages with assistant-only masks,
group filters, and `rl train` with `rollout.source: buffer` training on POSTed trajectories."""

import json
import os
import subprocess
import sys
import time

import pytest
import requests

from rlx.config import parse_config
from rlx.data.buffer import TrajectoryBuffer
from rlx.plugins import build_plugins
from rlx.rollout.engines.launch import free_port
from rlx.testing.background import BackgroundLoop

pytestmark = pytest.mark.integration
KEY = {"Authorization": "Bearer bk"}


@pytest.fixture(scope="module")
def buffer(tiny_model_path):
    from transformers import AutoTokenizer

    cfg = parse_config(json.dumps({"model": {"path": tiny_model_path},
                                   "rollout": {"source": "buffer", "buffer": {"api_key": "bk"},
                                               "dynamic_sampling": {"filter_zero_variance": True}}}))
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    buf = TrajectoryBuffer(cfg, tok, build_plugins(entry_points=False), max_len=200)
    with BackgroundLoop(buf.start, buf.stop):
        yield buf, tok


def post(buf, body, headers=KEY):
    # json.dumps writes NaN as Python's json reads it, as some clients do: the server must reject it
    return requests.post(buf.url + "/rlx/trajectories", data=json.dumps(body),
                         headers={**headers, "Content-Type": "application/json"})


def traj(reward, **kw):
    t = {"prompt_ids": [1, 20, 30], "response_ids": [40, 41, 2], "loss_mask": [1, 1, 1],
         "rollout_logprobs": [-0.1, -0.2, -0.3], "reward": reward}
    t.update(kw)
    return t


@pytest.mark.parametrize("bad,reason", [
    ({"reward": float("nan")}, "trajectories[1].reward: a finite number is required"),
    ({"response_ids": [40, 99999, 2]}, "trajectories[1].response_ids: id 99999 is outside the vocabulary"),
    ({"loss_mask": [1, 1]}, "trajectories[1].loss_mask: 2 entries for 3 response ids"),
    ({"loss_mask": [0, 0, 0]}, "trajectories[1].loss_mask: no token has mask 1"),
    ({"rollout_logprobs": [0.5, -1, -1]}, "trajectories[1].rollout_logprobs: 3 finite log-probs"),
    ({"prompt_ids": list(range(3, 300))}, "trajectories[1]: 300 tokens, longer than the model's 200"),
    ({"lossmask": [0, 1, 1]}, "trajectories[1]: unknown field(s) 'lossmask' (did you mean 'loss_mask'?)"),
    ({"id": 7}, "trajectories[1].id: a string of 1 to 256 characters"),
])
def test_a_bad_trajectory_rejects_its_post_with_a_reason(buffer, bad, reason):
    buf, _ = buffer
    before = buf.queue.qsize()
    r = post(buf, {"trajectories": [traj(1.0), {**traj(0.0), **bad}]})
    assert r.status_code == 400 and r.json()["queued"] is False and reason in r.json()["error"]
    assert buf.queue.qsize() == before


def test_a_trajectory_id_is_trained_once_and_oversized_posts_are_refused(buffer):
    buf, _ = buffer
    before = buf.queue.qsize()
    first = post(buf, {"trajectories": [traj(1.0, id="a-1"), traj(0.0, id="a-2")]})
    assert first.status_code == 200 and first.json()["queued"] is True
    again = post(buf, {"trajectories": [traj(1.0, id="a-3"), traj(0.0, id="a-2")]})  # a client's retry
    assert again.status_code == 400 and "trajectories[1].id: 'a-2' was already received" in again.json()["error"]
    twice = post(buf, {"trajectories": [traj(1.0, id="b"), traj(0.0, id="b")]})
    assert twice.status_code == 400 and "'b' appears twice in this POST" in twice.json()["error"]
    meta = post(buf, {"trajectories": [traj(1.0), traj(0.0)], "metadata": {"blob": "x" * 70_000}})
    assert meta.status_code == 400 and "metadata: 68 KB, over rollout.buffer.max_metadata_kb (64 KB" in meta.json()["error"]
    top = post(buf, {"trajectories": [traj(1.0), traj(0.0)], "meta": {}})
    assert top.status_code == 400 and "the body: unknown field(s) 'meta' (did you mean 'metadata'?)" in top.json()["error"]
    huge = requests.post(buf.url + "/rlx/trajectories", data=b"x" * (65 * 2**20),
                         headers={**KEY, "Content-Type": "application/json"})
    assert huge.status_code == 413
    assert buf.queue.qsize() == before + 1 and "a-3" not in buf.seen_ids
    items = [buf.queue.get_nowait() for _ in range(buf.queue.qsize())]  # the module's buffer: leave it as it was
    for g in items[:before]:
        buf.queue.put_nowait(g)


def test_auth_shape_and_messages_errors(buffer):
    buf, _ = buffer
    assert post(buf, {"trajectories": [traj(1.0)]}, headers={}).status_code == 401
    assert "a non-empty list" in post(buf, {"trajectories": []}).json()["error"]
    r = post(buf, {"trajectories": [{"messages": [{"role": "user", "content": "x"}], "reward": 1}]})
    assert "at least one assistant message" in r.json()["error"]


def test_token_trajectories_are_queued_exactly(buffer):
    buf, _ = buffer
    r = post(buf, {"trajectories": [traj(1.0), traj(0.0, weight_version=4)], "metadata": {"task": "t1"}})
    assert r.status_code == 200 and r.json()["queued"] is True
    group = buf.queue.get_nowait()
    a, b = group.samples
    assert a.response_ids == [40, 41, 2] and a.rollout_logprobs == [-0.1, -0.2, -0.3] and a.reward == 1.0
    assert b.weight_version == 4 and b.metadata["task"] == "t1" and a.sample_id != b.sample_id


def test_message_trajectories_mask_exactly_the_assistant_turns(buffer):
    buf, tok = buffer
    msgs = [{"role": "user", "content": "1 + 2"}, {"role": "assistant", "content": "3"},
            {"role": "user", "content": "times 4"}, {"role": "assistant", "content": "12"}]
    r = post(buf, {"trajectories": [{"messages": msgs, "reward": 1.0}, {"messages": msgs[:2], "reward": 0.0}]})
    assert r.json()["queued"] is True
    s = buf.queue.get_nowait().samples[0]

    def enc(t):
        return tok.encode(t, add_special_tokens=False)

    eos = [tok.eos_token_id]
    parts = [(enc("3") + eos, 1), (enc("\n<|im_start|>user\ntimes 4<|im_end|>\n<|im_start|>assistant\n"), 0),
             (enc("12") + eos, 1), (enc("\n"), 0)]
    assert s.prompt_ids == enc("<|im_start|>user\n1 + 2<|im_end|>\n<|im_start|>assistant\n")
    assert s.response_ids == [t for ids, _ in parts for t in ids]
    assert s.loss_mask == [m for ids, m in parts for _ in ids]
    assert s.metadata["retokenized"] is True


def test_filtered_groups_are_answered_but_not_queued(buffer):
    buf, _ = buffer
    r = post(buf, {"trajectories": [traj(1.0), traj(1.0)]})
    assert r.status_code == 200 and r.json()["queued"] is False and "same reward" in r.json()["reason"]


def test_rl_train_trains_on_posted_trajectories(tiny_model_path, tmp_path):
    port = free_port()
    cfg = tmp_path / "buf.yaml"
    cfg.write_text(f"run: {{output_dir: {tmp_path / 'out'}}}\nmodel: {{path: builtin://tiny-qwen3}}\n"
                   f"rollout: {{source: buffer, buffer: {{port: {port}, api_key: bk}}, n_prompts: 2,\n"
                   "  engines: [{server_args: {num_threads: 1}}]}\n"
                   "train: {num_steps: 2, optim: {lr: 1.0e-3}}\nray: {enabled: false}\n")
    p = subprocess.Popen([sys.executable, "-m", "rlx_cli.main", "train", str(cfg)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}/rlx/trajectories"
    sent = []
    deadline = time.monotonic() + 180
    while len(sent) < 4:
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()[-3000:]
        try:
            r = requests.post(url, json={"trajectories": [traj(1.0), traj(0.0), traj(0.5)]}, headers=KEY, timeout=5)
        except requests.ConnectionError:
            time.sleep(0.5)
            continue
        assert r.status_code == 200, r.text
        sent.append(r.json()["sample_ids"])
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    order = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [o["sample_ids"] for o in order] == [sent[0] + sent[1], sent[2] + sent[3]]  # arrival order
