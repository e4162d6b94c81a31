"""The coding-agent harnesses: the sandbox, the adapter, the task's tests as reward.

Fast tests put a stand-in CLI where `rl-coding-harness install` puts the real one: a Python program that speaks
to the adapter through the official SDK (Anthropic Messages for ``claude``, OpenAI Responses for ``codex``) from
inside the sandbox, and applies the fix the model "wrote". The integration tests run the real CLIs (installed by
``scripts/setup`` where npm is available) against ``rl serve`` on the real engine.
"""

import asyncio
import json
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
from rlx_agent_coding import ClaudeCode, Codex, cli_path, harness_dir

from rlx.agent.server import AgentAdapter
from rlx.config import SamplingConfig
from rlx.errors import RLXError
from rlx.rollout.context import GenerateContext
from rlx.rollout.engines.client import GenerateResult
from rlx.testing.background import BackgroundLoop

ROOT = Path(__file__).resolve().parents[4]
TASK = {"prompt": "The test in test_calc.py fails. Fix calc.py.", "sample_id": 0,
        "metadata": {"files": {"calc.py": "def add(a, b):\n    return a - b\n",
                               "test_calc.py": "from calc import add\nassert add(2, 3) == 5\n"},
                     "test": "python3 test_calc.py"}}
FIX = "FIX calc.py\ndef add(a, b):\n    return a + b\n"
CHEAT = "FIX test_calc.py\nprint('ok')\n"  # "passes" by rewriting the test

STAND_IN = """#!{python}
import json, os, re, sys
args = sys.argv[1:]
if "{cli}" == "claude":
    import anthropic
    assert args[0] == "-p" and "--max-turns" in args and args[-2] == "--" and os.environ["IS_SANDBOX"] == "1", args
    client = anthropic.Anthropic(base_url=os.environ["ANTHROPIC_BASE_URL"], api_key=os.environ["ANTHROPIC_API_KEY"],
                                 max_retries=0)
    text = client.messages.create(model="claude", max_tokens=64,
                                  messages=[{{"role": "user", "content": args[-1]}}]).content[0].text
else:
    import openai
    assert args[0] == "exec" and "model_provider=rlx" in args and args[-2] == "--", args
    provider = next(a for a in args if a.startswith("model_providers.rlx="))
    base_url = re.search(r'base_url="([^"]+)"', provider).group(1)
    client = openai.OpenAI(base_url=base_url, api_key=os.environ["RLX_API_KEY"], max_retries=0)
    text = client.responses.create(model="policy", input=args[-1], max_output_tokens=64).output_text
if text.startswith("FIX "):  # the "edit" the model asked for
    name, content = text[4:].split("\\n", 1)
    open(name, "w").write(content)
print(json.dumps({{"result": text, "home": os.environ["HOME"], "cwd": os.getcwd()}}))
"""


class ScriptedEngine:
    """A policy whose replies are given in order (an empty queue is an error the harness sees as a failed call)."""

    def __init__(self, tok):
        self.tok, self.replies, self.sent = tok, deque(), []

    def reply_ids(self, text):
        return self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]

    async def generate(self, req, retries=0):
        self.sent.append(list(req.input_ids))
        ids = self.reply_ids(self.replies.popleft())
        return [GenerateResult(text="", output_ids=ids, output_logprobs=[-0.5] * len(ids), finish_reason="stop",
                               matched_stop=None, weight_version="0", token_weight_versions=[], prompt_tokens=0,
                               rid=req.rid, raw={})]


@pytest.fixture
def stand_in(tmp_path):
    for cli in ("claude", "codex"):
        exe = tmp_path / "harness" / "node_modules" / ".bin" / cli
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text(STAND_IN.format(python=sys.executable, cli=cli))
        exe.chmod(0o755)
    return tmp_path / "harness"


@pytest.fixture
def adapter(tiny_model_path):
    yield from scripted_adapter(tiny_model_path)


@pytest.fixture
def code_adapter():
    """The adapter with the tokenizer and context of builtin://tiny-qwen3-code, which hold a harness's prompt."""
    from rlx.models.tiny import resolve_model_path

    yield from scripted_adapter(resolve_model_path("builtin://tiny-qwen3-code"))


def scripted_adapter(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    engine = ScriptedEngine(tok)
    a = AgentAdapter(GenerateContext(engine, tok, SamplingConfig(max_new_tokens=64)), api_key="k")
    with BackgroundLoop(a.start, a.stop):
        yield a, engine


@pytest.mark.parametrize("harness", [ClaudeCode, Codex], ids=["claude_code", "codex"])
def test_the_harness_edits_the_task_in_its_sandbox_and_the_tests_give_the_reward(stand_in, adapter, harness):
    """The model's reply reaches the harness through the sandbox's one open address, the harness's edit reaches
    the tests, and the call is the session's sample, token for token; a reply that fixes nothing scores 0, and
    so does one that rewrites the test (the task's tests are written back before they run)."""
    a, engine = adapter
    agent = harness(harness.Config(harness_dir=str(stand_in), time_limit_s=60))
    for reply, reward in ((FIX, 1.0), ("I cannot.", 0.0), (CHEAT, 0.0)):
        engine.replies.append(reply)
        session, key = a.open_session()
        ran, tests = asyncio.run(agent.attempt(a.base_url, key, TASK))
        assert ran.ok, ran.stderr[-2000:]
        out = json.loads(ran.stdout)
        assert out["result"] == reply and out["cwd"] == "/task" and out["home"] == "/tmp/home"
        assert tests.ok == (reward == 1.0), tests.stderr
        (sample,) = session.samples()
        assert a.ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True) == reply
        assert TASK["prompt"] in a.ctx.tokenizer.decode(sample.prompt_ids)
        a.close_session(session)
    engine.replies.append(FIX)  # the agent itself: the reward
    assert asyncio.run(agent.run(a.base_url, a.open_session()[1], TASK)) == 1.0


def test_a_missing_cli_and_a_task_without_files_or_tests_are_named_errors(stand_in, tmp_path):
    with pytest.raises(RLXError, match=r"claude CLI is not installed in .*rl-coding-harness install"):
        ClaudeCode(ClaudeCode.Config(harness_dir=str(tmp_path / "nowhere")))
    agent = Codex(Codex.Config(harness_dir=str(stand_in)))
    with pytest.raises(RLXError, match=r"needs metadata.files .* got keys \['files'\]"):
        asyncio.run(agent.run("http://127.0.0.1:1", "k", {"prompt": "x", "metadata": {"files": {"a.py": ""}}}))
    with pytest.raises(RLXError, match=r"test_files names \['t.py'\], which are not in metadata.files"):
        asyncio.run(agent.run("http://127.0.0.1:1", "k", {"prompt": "x", "metadata": {
            "files": {"a.py": ""}, "test": "true", "test_files": ["t.py"]}}))
    with pytest.raises(Exception, match="max_turns"):  # Codex has no turn limit: the option is not accepted
        Codex.Config(max_turns=2)
    with pytest.raises(RLXError, match=r"agent_args.env sets \['HOME', 'RLX_API_KEY'\], which rlx sets for the codex"):
        Codex(Codex.Config(harness_dir=str(stand_in), env={"RLX_API_KEY": "mine", "HOME": "/x", "OK": "1"}))


def test_test_files_are_named_or_found_by_name():
    from rlx_agent_coding import test_files

    files = {"calc.py": "", "test_calc.py": "", "pkg/x_test.py": "", "tests/helpers.py": "", "testing.py": ""}
    assert test_files({"files": files}) == ["test_calc.py", "pkg/x_test.py", "tests/helpers.py"]
    assert test_files({"files": files, "test_files": ["testing.py"]}) == ["testing.py"]


def test_the_example_tasks_fail_as_given(tmp_path):
    """Every task in examples/data/coding_tasks.jsonl is a failing test (so a reward of 1 means a fix)."""
    rows = [json.loads(line) for line in (ROOT / "examples/data/coding_tasks.jsonl").read_text().splitlines()]
    assert len(rows) >= 4
    for i, row in enumerate(rows):
        folder = tmp_path / str(i)
        for name, content in row["metadata"]["files"].items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(content)
        r = subprocess.run(["sh", "-c", row["metadata"]["test"]], cwd=folder, capture_output=True, text=True)
        assert r.returncode != 0 and "AssertionError" in r.stderr, (i, r.stderr)


# -- the real CLIs ---------------------------------------------------------------------------------


def installed(cli):
    path = cli_path(harness_dir(), cli)
    if path is None:
        pytest.skip(f"the {cli} CLI is not installed in {harness_dir()} (scripts/setup installs it where npm is "
                    f"available: rl-coding-harness install)")
    return path


@pytest.fixture(scope="module")
def served(tiny_model_path, tmp_path_factory):
    """`rl serve` on builtin://tiny-qwen3-code (the harnesses' prompts are ~10-22k tokens)."""
    from rlx.testing.processes import rl_serve

    folder = tmp_path_factory.mktemp("serve")
    cfg = folder / "serve.yaml"
    cfg.write_text(f"run: {{name: policy, output_dir: {folder / 'out'}}}\nmodel: {{path: builtin://tiny-qwen3-code}}\n"
                   "rollout:\n  engines: [{name: main}]\n")
    with rl_serve(cfg, "--max-output-tokens", "16") as base:
        yield base[:-3]


# each CLI's own shell tool, called as the tiny model's chat template (hermes) writes a call
def shell_call(cli, command):
    """A call of the CLI's own shell tool, as the tiny model's chat template (hermes) writes one."""
    call = ({"name": "Bash", "arguments": {"command": command, "description": "Run it"}} if cli == "claude"
            else {"name": "exec_command", "arguments": {"cmd": command}})
    return tool_call(call)


def tool_call(call):
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


FIX_COMMAND = "sed -i 's/a - b/a + b/' calc.py"


def scripted_run(code_adapter, harness, cli, replies, **config):
    """The real CLI on TASK against the adapter, the policy answering `replies` in order (all of them, and no
    more, must be asked for); (the CLI's run, the tests' run, the session's samples, the prompts sent)."""
    installed(cli)
    a, engine = code_adapter
    engine.replies.extend(replies)
    session, key = a.open_session()
    try:
        ran, tests = asyncio.run(harness(harness.Config(time_limit_s=120, **config)).attempt(a.base_url, key, TASK))
        assert ran.ok, (ran.returncode, ran.timed_out, ran.stdout[-2000:], ran.stderr[-3000:])
        assert not engine.replies and len(engine.sent) == len(replies), (len(engine.sent), engine.replies)
        assert tests.ok, tests.stderr  # the CLI's tool made the fix, in the task's folder
        assert sum(session.mismatch_counts().values()) == 0
        return ran, session.samples(), engine.sent
    finally:
        a.close_session(session)


@pytest.mark.integration
@pytest.mark.parametrize("harness,cli", [(ClaudeCode, "claude"), (Codex, "codex")], ids=["claude_code", "codex"])
def test_the_real_cli_runs_the_policys_tool_call_and_sends_back_its_result(code_adapter, harness, cli):
    """A multi-turn tool task with the unmodified CLI: a scripted policy calls the CLI's own shell tool with the
    fix, the CLI runs it in the sandbox and sends the result back, the policy says it is done and the CLI exits
    0; the task's tests pass. The trajectory is one sample: the call and the final answer trained (mask 1), the
    tool's result between them not (mask 0), token for token what the policy sampled."""
    call = shell_call(cli, FIX_COMMAND)
    ran, samples, sent = scripted_run(code_adapter, harness, cli, [call, "Done."])
    if cli == "claude":
        out = json.loads(ran.stdout)
        assert out["num_turns"] == 2 and out["result"] == "Done." and out["stop_reason"] == "end_turn", out
    else:
        assert "succeeded" in ran.stderr and ran.stdout.strip() == "Done.", (ran.stdout, ran.stderr[-2000:])
    (sample,) = samples
    assert sample.prompt_ids == sent[0]
    tool_turn = sent[1][len(sent[0]):]  # what the second request added after the first prompt
    engine = code_adapter[1]
    call_ids, done_ids = engine.reply_ids(call), engine.reply_ids("Done.")
    assert tool_turn[:len(call_ids)] == call_ids  # the call as sampled, not re-encoded from the parsed tool_use
    result_ids = tool_turn[len(call_ids):]
    assert sample.response_ids == call_ids + result_ids + done_ids
    assert sample.loss_mask == [1] * len(call_ids) + [0] * len(result_ids) + [1] * len(done_ids)
    assert code_adapter[0].ctx.tokenizer.decode(result_ids).startswith("\n<|im_start|>tool\n")


@pytest.mark.integration
def test_a_claude_code_subagent_is_a_branch_of_the_session(code_adapter):
    """The policy hands the fix to a subagent (Claude Code's Agent tool); the subagent's own conversation, with
    its own system prompt, is a second sample of the session, and its answer is the main one's tool result."""
    agent = tool_call({"name": "Agent", "arguments": {"description": "Fix calc", "subagent_type": "claude",
                                                      "prompt": "Fix calc.py so that add returns a + b."}})
    _, samples, sent = scripted_run(code_adapter, ClaudeCode, "claude",
                                    [agent, shell_call("claude", FIX_COMMAND), "Fixed it.", "Done."])
    tok = code_adapter[0].ctx.tokenizer
    main, sub = samples
    assert main.prompt_ids == sent[0] and sub.prompt_ids == sent[1]
    assert "cc_is_subagent=true" in tok.decode(sub.prompt_ids[:100]) and "cc_is_subagent" not in tok.decode(sent[0][:100])
    assert tok.decode(sub.response_ids).endswith("Fixed it.<|im_end|>") and sum(sub.loss_mask) < len(sub.loss_mask)
    assert "Fixed it." in tok.decode(main.response_ids) and tok.decode(main.response_ids).endswith("Done.<|im_end|>")


@pytest.mark.integration
@pytest.mark.parametrize("harness,cli,config", [
    (ClaudeCode, "claude", {"env": {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000",  # its smallest
                                    "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "25"}}),  # compact past 25,000 tokens
    (Codex, "codex", {"args": ["-c", "model_auto_compact_token_limit=12000"]}),
], ids=["claude_code", "codex"])
def test_a_compaction_by_the_real_cli_is_a_branch_of_the_session(code_adapter, harness, cli, config):
    """A long tool result pushes the conversation past the CLI's compaction limit: the CLI asks the policy for a
    summary and goes on from it. The summary request and the conversation after it are samples of their own;
    the first sample keeps the turns before the compaction."""
    n = 3000 if cli == "claude" else 1500  # `seq 1 n`: ~8,800 and ~4,400 tokens of output
    replies = [shell_call(cli, f"seq 1 {n}"), shell_call(cli, FIX_COMMAND), "Summary one.", "Done."]
    ran, samples, sent = scripted_run(code_adapter, harness, cli, replies, **config)
    tok = code_adapter[0].ctx.tokenizer
    before, summary, after = samples
    assert [s.prompt_ids for s in samples] == [sent[0], sent[2], sent[3]]
    long_result = f"\n{n - 1}\n"
    assert long_result in tok.decode(before.response_ids)
    untrained = [t for t, m in zip(before.response_ids, before.loss_mask, strict=True) if m == 0]
    assert long_result in tok.decode(untrained)  # the tool's output is not trained on
    assert tok.decode(summary.response_ids) == "Summary one.<|im_end|>" and all(summary.loss_mask)
    assert "Summary one." in tok.decode(after.prompt_ids) and long_result not in tok.decode(after.prompt_ids)
    assert tok.decode(after.response_ids) == "Done.<|im_end|>"
    if cli == "codex":
        assert "context compacted" in ran.stderr


@pytest.mark.integration
@pytest.mark.parametrize("harness,cli", [(ClaudeCode, "claude"), (Codex, "codex")], ids=["claude_code", "codex"])
def test_the_real_cli_finishes_a_task_against_rl_serve(served, harness, cli):
    """The unmodified CLI, in the sandbox, sends its own prompt and tools to `rl serve` and exits 0 with the
    policy's answer; the task's tests then run (the random tiny model fixes nothing: they fail)."""
    installed(cli)
    agent = harness(harness.Config(time_limit_s=240))
    ran, tests = asyncio.run(agent.attempt(served, "k1", TASK))
    assert ran.ok, (ran.returncode, ran.timed_out, ran.stdout[-2000:], ran.stderr[-3000:])
    if cli == "claude":
        out = json.loads(ran.stdout)
        assert out["is_error"] is False and out["num_turns"] >= 1 and out["usage"]["output_tokens"] >= 1, out
        assert out["usage"]["input_tokens"] + out["usage"]["cache_read_input_tokens"] > 5000  # its real prompt
    else:
        assert "tokens used" in ran.stderr, ran.stderr[-2000:]
    assert not tests.ok and "AssertionError" in tests.stderr
