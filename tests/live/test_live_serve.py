"""`rl serve` backed by a live SGLang 0.5.23 server on the CPU: the official OpenAI and Anthropic SDKs talk to
it through rlx's adapter, a second turn is served from SGLang's prefix cache, a real coding-agent CLI (Claude
Code, unmodified, in its sandbox) finishes a one-turn task, and Ctrl-C stops everything."""

import asyncio
import json

import anthropic
import openai
import pytest

from rlx.testing.processes import rl_serve

pytestmark = [pytest.mark.integration, pytest.mark.live]


def rl_serve_on_sglang(folder, model: str, sglang_py: str, *args: str):
    cfg = folder / "serve.yaml"
    cfg.write_text(f"run: {{name: policy, output_dir: {folder / 'out'}}}\nmodel: {{path: {model}}}\n"
                   f"rollout:\n  sampling: {{max_new_tokens: 8}}\n"
                   f"  engines: [{{backend: sglang, python: {sglang_py}}}]\n")
    return rl_serve(cfg, *args)


def test_rl_serve_on_sglang_answers_both_sdks_then_stops_cleanly(sglang_py, tiny_model_path, tmp_path):
    with rl_serve_on_sglang(tmp_path, "builtin://tiny-qwen3", sglang_py) as base:
        client = openai.OpenAI(base_url=base, api_key="k1")
        turn = [{"role": "user", "content": "1 + 1"}]
        r = client.chat.completions.create(model="tiny", messages=turn, max_tokens=5)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        turn += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and 2 + 2?"}]
        r2 = client.chat.completions.create(model="tiny", messages=turn, max_tokens=5)
        cached = r2.usage.prompt_tokens_details.cached_tokens
        print(f"rl serve on SGLang: second turn {r2.usage.prompt_tokens} prompt tokens, {cached} from SGLang's cache")
        assert 0 < cached < r2.usage.prompt_tokens
        chunks = list(client.chat.completions.create(model="tiny", messages=turn[:1], max_tokens=4, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
            ["stop"], ["length"])
        m = anthropic.Anthropic(base_url=base[:-3], api_key="k1").messages.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": "1 + 1"}])
        assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1


def test_claude_code_finishes_a_task_against_rl_serve_on_sglang(sglang_py, tiny_model_path, tmp_path):
    """The unmodified CLI sends its own ~10-20k-token prompt and tools through rlx's Anthropic adapter to SGLang
    and exits 0 with the policy's answer; the task's tests then run (the random model fixes nothing)."""
    from rlx_agent_coding import ClaudeCode, cli_path, harness_dir

    if cli_path(harness_dir(), "claude") is None:
        pytest.skip(f"the claude CLI is not installed in {harness_dir()} (rl-coding-harness install)")
    task = {"prompt": "The test in test_calc.py fails. Fix calc.py.", "sample_id": 0,
            "metadata": {"files": {"calc.py": "def add(a, b):\n    return a - b\n",
                                   "test_calc.py": "from calc import add\nassert add(2, 3) == 5\n"},
                         "test": "python3 test_calc.py"}}
    with rl_serve_on_sglang(tmp_path, "builtin://tiny-qwen3-code", sglang_py, "--max-output-tokens", "16") as base:
        ran, tests = asyncio.run(ClaudeCode(ClaudeCode.Config(time_limit_s=240)).attempt(base[:-3], "k1", task))
    assert ran.ok, (ran.returncode, ran.timed_out, ran.stdout[-2000:], ran.stderr[-3000:])
    out = json.loads(ran.stdout)
    print(f"Claude Code against rl serve on SGLang: {out['num_turns']} turn(s), {out['usage']['input_tokens']} + "
          f"{out['usage']['cache_read_input_tokens']} cached prompt tokens")
    assert out["is_error"] is False and out["usage"]["output_tokens"] >= 1
    assert out["usage"]["input_tokens"] + out["usage"]["cache_read_input_tokens"] > 5000  # its real prompt
    assert not tests.ok and "AssertionError" in tests.stderr
