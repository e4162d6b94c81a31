"""`rl serve`: engines, router and adapter from a config; the official SDKs talk to the real engine;
Ctrl-C stops everything it started, and so does SIGTERM."""

import re
import signal

import anthropic
import openai
import pytest

from rlx.testing.processes import rl_serve

pytestmark = pytest.mark.integration


def test_rl_serve_answers_both_sdks_then_stops_cleanly(tiny_model_path, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"run: {{name: tiny, output_dir: {tmp_path / 'out'}}}\nmodel: {{path: builtin://tiny-qwen3}}\n"
                   "rollout:\n  sampling: {max_new_tokens: 8}\n  engines: [{server_args: {num_threads: 1}}]\n")
    with rl_serve(cfg) as base:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", base)
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


def test_sigterm_stops_rl_serve_as_ctrl_c_does(tiny_model_path, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"run: {{name: tiny, output_dir: {tmp_path / 'out'}}}\nmodel: {{path: builtin://tiny-qwen3}}\n"
                   "rollout:\n  engines: [{server_args: {num_threads: 1}}]\n")
    with rl_serve(cfg, stop=signal.SIGTERM) as base:
        r = openai.OpenAI(base_url=base, api_key="k1").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "1 + 1"}], max_tokens=2)
        assert r.usage.completion_tokens >= 1
