"""`rl serve`: engines, router and adapter from a config; the official SDKs talk to the real engine;
Ctrl-C stops everything it started."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import anthropic
import openai
import pytest

from rlx.rollout.engines.launch import free_port
from rlx.testing.processes import processes_tagged, wait_gone

pytestmark = pytest.mark.integration


def test_rl_serve_answers_both_sdks_then_stops_cleanly(tiny_model_path, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"run: {{name: tiny, output_dir: {tmp_path / 'out'}}}\nmodel: {{path: builtin://tiny-qwen3}}\n"
                   "rollout:\n  sampling: {max_new_tokens: 8}\n  engines: [{server_args: {num_threads: 1}}]\n")
    tag = uuid.uuid4().hex
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "rlx_cli.main", "serve", str(cfg), "--port", str(port),
                          "--api-key", "k1"], env={**os.environ, "RLX_TEST_TAG": tag},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 180
        while "base_url" not in line:
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read()[-3000:]
            line = p.stdout.readline()
        base = re.search(r"base_url (\S+)", line).group(1)
        assert base == f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base, api_key="k1")
        turn = [{"role": "user", "content": "1 + 1"}]
        r = client.chat.completions.create(model="tiny", messages=turn, max_tokens=5)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        # the second turn resends the first: the engine's prefix cache holds it, so only the new tokens prefill
        turn += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and 2 + 2?"}]
        r2 = client.chat.completions.create(model="tiny", messages=turn, max_tokens=5)
        assert r.usage.prompt_tokens <= r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens
        m = anthropic.Anthropic(base_url=base[:-3], api_key="k1").messages.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": "1 + 1"}])
        assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(60)
    assert p.returncode == 0, p.stderr.read()[-3000:]
    assert wait_gone(tag) == [], f"left behind: {processes_tagged(tag)}"
