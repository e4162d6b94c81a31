"""The adapter server against the official `openai` and `anthropic` SDKs, unchanged, over real HTTP.

The engine below the adapter is scripted (it returns chosen token ids), so that tool calls, reasoning,
stop reasons and exact token bookkeeping can be checked; the end-to-end example test runs the real
engine. A property test drives many multi-turn sessions with random sampled ids and checks the
training sample id for id against an independent rendering of ChatML.
"""

import json
from collections import deque

import anthropic
import openai
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlx.agent.server import AgentAdapter
from rlx.config import SamplingConfig
from rlx.rollout.context import GenerateContext
from rlx.rollout.engines.client import EngineError, GenerateResult
from rlx.testing.background import BackgroundLoop

pytestmark = pytest.mark.integration


class ScriptedEngine:
    """Returns the next scripted (ids, finish) for each request, and records what it was sent."""

    def __init__(self):
        self.script = deque()
        self.sent = []
        self.params = []

    async def generate(self, req, retries=0):
        step = self.script.popleft()
        self.sent.append(list(req.input_ids))
        self.params.append(dict(req.sampling_params))
        if isinstance(step, Exception):
            raise step
        ids, finish = step
        return [GenerateResult(text="", output_ids=list(ids), output_logprobs=[-0.25] * len(ids), finish_reason=finish,
                               matched_stop=None, weight_version="3", token_weight_versions=[], prompt_tokens=0,
                               rid=req.rid, raw={})]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    engine = ScriptedEngine()
    ctx = GenerateContext(engine, tok, SamplingConfig(max_new_tokens=64))
    adapter = AgentAdapter(ctx, api_key="test-key", model_name="tiny")
    with BackgroundLoop(adapter.start, adapter.stop):
        yield adapter, engine, tok


def say(engine, tok, text, finish="stop"):
    ids = tok.encode(text, add_special_tokens=False)
    engine.script.append((ids + [tok.eos_token_id] if finish == "stop" else ids, finish))


def oa(server, key="test-key"):
    return openai.OpenAI(base_url=server[0].base_url + "/v1", api_key=key, max_retries=0)


def an(server, key="test-key"):
    return anthropic.Anthropic(base_url=server[0].base_url, api_key=key, max_retries=0)


CALC = {"type": "function", "function": {"name": "add", "description": "add two numbers",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                                         "b": {"type": "number"}}}}}
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def test_openai_chat_plain_and_streaming(server):
    adapter, engine, tok = server
    client = oa(server)
    say(engine, tok, "the answer is 5")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2 + 3"}])
    assert r.choices[0].message.content == "the answer is 5" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(tok.encode("the answer is 5")) + 1
    say(engine, tok, "<think>add them</think>five")
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2 + 3"}],
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "five" and chunks[-1].usage.total_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_openai_chat_tool_calls_whole_and_streamed(server):
    adapter, engine, tok = server
    client = oa(server)
    say(engine, tok, CALL_TEXT)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2 + 3"}], tools=[CALC])
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    say(engine, tok, CALL_TEXT)
    with client.beta.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "2 + 3"}],
                                             tools=[CALC]) as stream:
        final = stream.get_final_completion()
    assert json.loads(final.choices[0].message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    # the engine saw the tools rendered by the chat template
    assert "# Tools" in tok.decode(engine.sent[-1])


def test_openai_responses_whole_streamed_and_with_tools(server):
    adapter, engine, tok = server
    client = oa(server)
    say(engine, tok, "hello there")
    r = client.responses.create(model="tiny", input="hi", instructions="be brief")
    assert r.output_text == "hello there" and r.status == "completed"
    say(engine, tok, "again")
    r2 = client.responses.create(model="tiny", input="once more", previous_response_id=r.id)
    assert r2.output_text == "again"
    assert "hello there" in tok.decode(engine.sent[-1])  # the earlier turn came from the stored response
    say(engine, tok, "streamed text")
    with client.responses.stream(model="tiny", input="hi") as stream:
        final = stream.get_final_response()
    assert final.output_text == "streamed text"
    say(engine, tok, CALL_TEXT)
    tool = {"type": "function", "name": "add", "description": "add", "parameters": CALC["function"]["parameters"]}
    r = client.responses.create(model="tiny", input="2 + 3", tools=[tool])
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 2, "b": 3}


def test_anthropic_messages_plain_streaming_tools_and_count(server):
    adapter, engine, tok = server
    client = an(server)
    say(engine, tok, "<think>easy</think>it is 5")
    m = client.messages.create(model="tiny", max_tokens=32, system="be brief",
                               messages=[{"role": "user", "content": "2 + 3"}])
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == "it is 5"
    assert m.stop_reason == "end_turn" and m.usage.output_tokens > 0
    say(engine, tok, "streamed")
    with client.messages.stream(model="tiny", max_tokens=32, messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    assert final.content[0].text == "streamed"
    say(engine, tok, CALL_TEXT)
    tools = [{"name": "add", "description": "add", "input_schema": CALC["function"]["parameters"]}]
    with client.messages.stream(model="tiny", max_tokens=64, tools=tools,
                                messages=[{"role": "user", "content": "2 + 3"}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == {"a": 2, "b": 3}
    say(engine, tok, "cut", finish="length")
    m = client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert m.stop_reason == "max_tokens"
    n = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "2 + 3"}])
    rendered = tok.apply_chat_template([{"role": "user", "content": "2 + 3"}], add_generation_prompt=True,
                                       tokenize=False)
    assert n.input_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_models_lists_the_policy(server):
    assert [m.id for m in oa(server).models.list()] == ["tiny"]


def test_missing_or_wrong_key_is_401_in_each_api_shape(server):
    with pytest.raises(openai.AuthenticationError) as e:
        oa(server, key="wrong").chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError) as e:
        an(server, key="wrong").messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    r = requests.post(server[0].base_url + "/v1/chat/completions", json={})
    assert r.status_code == 401 and "error" in r.json()


def test_malformed_requests_get_4xx_in_the_right_shape(server):
    url, h = server[0].base_url, {"Authorization": "Bearer test-key"}
    r = requests.post(url + "/v1/chat/completions", data="{not json", headers=h)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = requests.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard"}]}, headers=h)
    assert r.status_code == 400 and "messages[0].role" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).chat.completions.create(model="tiny", messages=[], temperature=1.0)
    assert "messages: must not be empty" in e.value.body["message"]
    r = requests.post(url + "/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                      headers={"x-api-key": "test-key"})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: field required"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        an(server).messages.create(model="tiny", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    assert "unsupported block 'image'" in e.value.body["error"]["message"]
    r = requests.post(url + "/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": "resp_no"},
                      headers=h)
    assert r.status_code == 404


def test_a_tool_using_session_is_one_sample_with_exact_ids_and_mask(server):
    adapter, engine, tok = server
    session, key = adapter.open_session()
    client = oa(server, key=key)
    say(engine, tok, CALL_TEXT)
    messages = [{"role": "user", "content": "what is 2 + 3?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[CALC])
    msg = r.choices[0].message
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"}]
    say(engine, tok, "it is 5")
    client.chat.completions.create(model="tiny", messages=messages, tools=[CALC])
    (sample,) = session.samples()
    assert [t.kind for t in session.turns] == ["start", "append"]
    first = tok.encode(CALL_TEXT, add_special_tokens=False) + [tok.eos_token_id]
    tool = tok.encode("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    second = tok.encode("it is 5", add_special_tokens=False) + [tok.eos_token_id]
    assert sample.response_ids == first + tool + second
    assert sample.loss_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
    assert sample.rollout_logprobs == [-0.25] * len(first) + [0.0] * len(tool) + [-0.25] * len(second)
    assert engine.sent[-1] == sample.prompt_ids + first + tool  # the engine saw exactly the buffer
    assert session.mismatch_counts() == {}
    adapter.close_session(session)


def test_a_harness_that_rewrites_history_forks_a_new_chain(server):
    adapter, engine, tok = server
    session, key = adapter.open_session()
    client = oa(server, key=key)
    say(engine, tok, "first")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}])
    say(engine, tok, "second")  # a compacted context: a new conversation with a summary
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "summary: a -> first"}])
    say(engine, tok, "third")  # the harness stripped whitespace from the model's turn: realign, same chain
    client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": " first "},
        {"role": "user", "content": "b"}])
    assert [t.kind for t in session.turns] == ["start", "fork", "append"]
    assert [t.chain for t in session.turns] == [0, 1, 0]
    chains = session.samples()
    assert len(chains) == 2
    # the last turn went to chain 0: it holds the trajectory's answer; each records what the engine sampled
    assert [s.metadata.get("final", False) for s in chains] == [True, False]
    assert [s.metadata["sampled_tokens"] for s in chains] == [sum(s.loss_mask) for s in chains]


# -- property: id for id ---------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(st.lists(st.integers(3, 400), min_size=1, max_size=12), st.booleans(),
                                st.text(alphabet="0123456789 abc+=", min_size=0, max_size=12)),
                      min_size=1, max_size=4))
def test_sessions_hold_exactly_the_sampled_ids_plus_rendered_non_model_tokens(server, turns):
    adapter, engine, tok = server
    special = set(tok.all_special_ids)
    session, key = adapter.open_session()
    client = oa(server, key=key)
    messages = [{"role": "user", "content": "start"}]
    want_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    prompt_len = len(want_ids)
    want_mask: list[int] = []
    for i, (ids, stopped, user_text) in enumerate(turns):
        ids = [t for t in ids if t not in special and t < len(tok)]
        sampled = ids + [tok.eos_token_id] if stopped else ids
        engine.script.append((sampled, "stop" if stopped else "length"))
        r = client.chat.completions.create(model="tiny", messages=messages)
        want_ids += sampled
        want_mask += [1] * len(sampled)
        if i == len(turns) - 1:
            break
        # the harness echoes the reply as text (which may re-tokenize differently) and adds a user turn
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": user_text}]
        close = "\n" if stopped else "<|im_end|>\n"
        rendered = tok.encode(f"{close}<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)
        want_ids += rendered
        want_mask += [0] * len(rendered)
    (sample,) = session.samples()
    assert sample.prompt_ids + sample.response_ids == want_ids
    assert sample.loss_mask == want_mask and len(sample.prompt_ids) == prompt_len
    assert all(k == "append" for k in (t.kind for t in session.turns[1:]))
    adapter.close_session(session)


def test_header_sessions_and_stored_responses_are_bounded(server):
    adapter, engine, tok = server
    adapter.max_hinted_sessions, adapter.max_history = 2, 2
    try:
        for name in ("h1", "h2", "h3"):
            say(engine, tok, "ok")
            openai.OpenAI(base_url=adapter.base_url + "/v1", api_key="test-key", max_retries=0,
                          default_headers={"x-rlx-session": name}).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}])
        assert "h1" not in adapter.sessions and {"h2", "h3"} <= set(adapter.sessions)
        assert adapter.sessions["h3"].turns[0].kind == "start"
        for _ in range(3):
            say(engine, tok, "ok")
            oa(server).responses.create(model="tiny", input="x")
        assert len(adapter.history) == 2
    finally:
        adapter.max_hinted_sessions = adapter.max_history = 10_000


def test_a_prompt_past_the_context_gets_each_apis_own_error_and_unset_limits_run_to_the_context(server):
    """What makes a harness compact its conversation: OpenAI's context_length_exceeded, Anthropic's "prompt is too
    long" (400s, before any generation). Without max_tokens an answer may fill the context, as the APIs allow;
    a larger max_tokens is cut to fit."""
    adapter, engine, tok = server
    adapter.ctx.context_length = 64
    try:
        long = [{"role": "user", "content": "word " * 100}]
        with pytest.raises(openai.BadRequestError) as e:
            oa(server).chat.completions.create(model="tiny", messages=long)
        assert e.value.code == "context_length_exceeded" and "maximum context length is 64 tokens" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            oa(server).responses.create(model="tiny", input="word " * 100)
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(anthropic.BadRequestError) as e:
            an(server).messages.create(model="tiny", max_tokens=10, messages=long)
        assert "prompt is too long" in e.value.message and e.value.body["error"]["type"] == "invalid_request_error"
        assert not engine.script and len(engine.sent) == len(engine.params)  # nothing reached the engine

        say(engine, tok, "ok")
        oa(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert engine.params[-1]["max_new_tokens"] == 64 - len(engine.sent[-1]) - 1
        say(engine, tok, "ok")
        with an(server).messages.stream(model="tiny", max_tokens=64000,  # as Claude Code asks (streamed)
                                        messages=[{"role": "user", "content": "hi"}]) as stream:
            assert stream.get_final_message().content[0].text == "ok"
        assert engine.params[-1]["max_new_tokens"] == 64 - len(engine.sent[-1]) - 1

        # a session whose next turn no longer fits: that chain ends there, truncated, and trains as such
        session, key = adapter.open_session()
        say(engine, tok, "ok")
        turn = [{"role": "user", "content": "hi"}]
        r = oa(server, key=key).chat.completions.create(model="tiny", messages=turn, max_tokens=4)
        turn += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "word " * 100}]
        with pytest.raises(openai.BadRequestError):
            oa(server, key=key).chat.completions.create(model="tiny", messages=turn, max_tokens=4)
        (sample,) = session.samples()
        assert sample.status.name == "TRUNCATED" and sample.finish_reason == "length"
        adapter.close_session(session)
    finally:
        adapter.ctx.context_length = None


def test_sessions_are_managed_with_the_adapters_key_only(server):
    """POST /rlx/sessions gives a session and its key; that key talks to the model, but cannot make sessions or
    read any (a harness holds it, and so does the code the policy writes)."""
    adapter, engine, tok = server
    r = requests.post(adapter.base_url + "/rlx/sessions", headers={"Authorization": "Bearer test-key"})
    assert r.status_code == 200
    sid, key = r.json()["session_id"], r.json()["api_key"]
    say(engine, tok, "ok")
    oa(server, key=key).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    for method, path in (("post", "/rlx/sessions"), ("get", f"/rlx/sessions/{sid}")):
        r = getattr(requests, method)(adapter.base_url + path, headers={"x-api-key": key})
        assert r.status_code == 403 and "cannot manage sessions" in r.text, (path, r.text)
    r = requests.get(adapter.base_url + f"/rlx/sessions/{sid}", headers={"Authorization": "Bearer test-key"})
    assert r.status_code == 200 and len(r.json()["turns"]) == 1 and len(r.json()["samples"]) == 1
    adapter.close_session(adapter.sessions[sid])


def test_a_maximum_output_bounds_every_call_as_training_sets_it(server):
    """Training serves harnesses that ask for tens of thousands of tokens a call: the adapter's maximum output
    (rollout.sampling.max_new_tokens) lowers a larger or unset max_tokens, and leaves a smaller one. A reply cut
    by that maximum is a finished turn to the harness (Claude Code exits 1 on max_tokens), and truncated in the
    sample; one cut by the caller's own max_tokens is reported as such."""
    adapter, engine, tok = server
    adapter.max_output_tokens = 7
    try:
        hi = [{"role": "user", "content": "hi"}]
        for ask, want in ((64000, 7), (None, 7), (3, 3)):
            say(engine, tok, "ok")
            kw = {} if ask is None else {"max_tokens": ask}
            oa(server).chat.completions.create(model="tiny", messages=hi, **kw)
            assert engine.params[-1]["max_new_tokens"] == want, ask
        session, key = adapter.open_session()
        engine.script.append(([5] * 7, "length"))
        with an(server, key=key).messages.stream(model="tiny", max_tokens=32000, messages=hi) as stream:  # as
            assert stream.get_final_message().stop_reason == "end_turn"  # Claude Code asks (streamed)
        assert engine.params[-1]["max_new_tokens"] == 7
        (sample,) = session.samples()
        assert sample.status.name == "TRUNCATED" and sample.finish_reason == "length"
        adapter.close_session(session)
        engine.script.append(([5] * 3, "length"))
        r = oa(server).chat.completions.create(model="tiny", messages=hi, max_tokens=3)
        assert r.choices[0].finish_reason == "length"
    finally:
        adapter.max_output_tokens = None


def test_claude_codes_first_request_and_a_system_turn_mid_conversation(server):
    """``HEAD /`` answers; a system message inside ``messages`` (Anthropic's mid-conversation system beta) is
    rendered where it stands."""
    adapter, engine, tok = server
    assert requests.head(adapter.base_url + "/", timeout=10).status_code == 200
    say(engine, tok, "ok")
    an(server).messages.create(model="tiny", max_tokens=10, system=[{"type": "text", "text": "You code.",
                                                                     "cache_control": {"type": "ephemeral"}}],
                               messages=[{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "hello"},
                                         {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                         {"role": "user", "content": "go"}])
    text = tok.decode(engine.sent[-1])
    assert text.index("You code.") < text.index("hi") < text.index("hello") < text.index("Be brief.") < text.index("go")


def test_codex_style_tools_namespaces_expanded_and_hosted_tools_left_out(server):
    """Codex sends function tools grouped under a ``namespace`` and hosted tools (``web_search``): the model is
    offered ``<namespace>.<name>`` functions and not the hosted tool (no 400), its call comes back with name and
    namespace apart, and the call replayed as input renders as the model made it."""
    adapter, engine, tok = server
    client = oa(server)
    tools = [{"type": "namespace", "name": "collab", "description": "agents",
              "tools": [{"type": "function", "name": "spawn", "description": "spawn an agent",
                         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]},
             {"type": "web_search"},
             {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}}]
    call = '<tool_call>\n{"name": "collab.spawn", "arguments": {"task": "x"}}\n</tool_call>'
    say(engine, tok, call)
    r = client.responses.create(model="tiny", input="go", tools=tools, store=False, include=[],
                                prompt_cache_key="k1")
    prompt = tok.decode(engine.sent[-1])
    assert '"collab.spawn"' in prompt and '"shell"' in prompt and "web_search" not in prompt
    (fc,) = [o for o in r.output if o.type == "function_call"]
    assert fc.name == "spawn" and fc.namespace == "collab" and json.loads(fc.arguments) == {"task": "x"}
    say(engine, tok, "done")
    client.responses.create(model="tiny", tools=tools, input=[
        {"type": "message", "role": "user", "content": "go"},
        {"type": "function_call", "call_id": fc.call_id, "name": "spawn", "namespace": "collab",
         "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "spawned"}])
    assert tok.decode(engine.sent[-1]).count('"collab.spawn"') == 2  # offered, and the replayed call


def test_an_engine_that_refuses_the_request_is_the_callers_400_and_a_failed_engine_a_503(server):
    adapter, engine, tok = server
    engine.script.append(EngineError("POST /generate -> HTTP 400: The input (99 tokens) is longer than ...", 400))
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert "the engine refused the request" in e.value.message and "longer than" in e.value.message
    engine.script.append(EngineError("POST /generate: connection refused"))
    with pytest.raises(anthropic.InternalServerError) as e:
        an(server).messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 503 and e.value.body["error"]["type"] == "api_error"
