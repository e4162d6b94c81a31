"""Adapter overhead per turn, generation excluded: what rlx's OpenAI/Anthropic adapter adds to a turn.

Multi-turn sessions (a tool call, a tool result, an answer: like an agent loop) run through the adapter
with an engine that answers at once with fixed token ids, so that nothing but the adapter is timed:
parsing the request, matching the session, rendering only the new messages, the token comparator,
decoding and parsing the reply, building the response. Two figures per API:

* server: time in the adapter's handler minus time in the engine call (the target: p50 under 2 ms);
* client round trip: the official SDK's call over loopback HTTP with the instant engine (adds HTTP,
  JSON and the SDK's own work).

    scripts/loopback .venv/bin/python benchmarks/adapter_overhead.py [--sessions 100] [--turns 4]
"""

from __future__ import annotations

import argparse
import statistics
import time


class InstantEngine:
    def __init__(self, ids: list[int]):
        self.ids = ids

    async def generate(self, req, retries=0):
        from rlx.rollout.engines.client import GenerateResult

        return [GenerateResult(text="", output_ids=self.ids, output_logprobs=[-0.1] * len(self.ids),
                               finish_reason="stop", matched_stop=None, weight_version="0", token_weight_versions=[],
                               prompt_tokens=len(req.input_ids), rid=req.rid, raw={})]


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--no-compare", action="store_true", help="turn the token comparator off")
    args = ap.parse_args()

    import anthropic
    import openai
    from transformers import AutoTokenizer

    from rlx.agent.server import AgentAdapter
    from rlx.config import SamplingConfig
    from rlx.models.tiny import resolve_model_path
    from rlx.rollout.context import GenerateContext
    from rlx.testing.background import BackgroundLoop

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin://tiny-qwen3"))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
    ids = tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]
    adapter = AgentAdapter(GenerateContext(InstantEngine(ids), tok, SamplingConfig()), api_key="k",
                           compare=not args.no_compare)
    background = BackgroundLoop(adapter.start, adapter.stop).__enter__()
    tools = [{"type": "function", "function": {"name": "calculator", "description": "evaluate arithmetic",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}}}}}]
    results = {}
    for api in ("chat", "messages"):
        adapter.overheads.clear()
        rtt = []
        for s in range(args.sessions):
            session, key = adapter.open_session()
            if api == "chat":
                client = openai.OpenAI(base_url=adapter.base_url + "/v1", api_key=key, max_retries=0)
                messages = [{"role": "system", "content": "You are a careful calculator agent."},
                            {"role": "user", "content": f"what is 12 * 7 plus {s}?"}]
                for _ in range(args.turns):
                    t0 = time.perf_counter()
                    r = client.chat.completions.create(model="rlx", messages=messages, tools=tools)
                    rtt.append(time.perf_counter() - t0)
                    msg = r.choices[0].message
                    messages += [msg.model_dump(exclude_none=True),
                                 {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "84"}]
                client.close()
            else:
                client = anthropic.Anthropic(base_url=adapter.base_url, api_key=key, max_retries=0)
                atools = [{"name": "calculator", "description": "evaluate arithmetic",
                           "input_schema": tools[0]["function"]["parameters"]}]
                messages = [{"role": "user", "content": f"what is 12 * 7 plus {s}?"}]
                for _ in range(args.turns):
                    t0 = time.perf_counter()
                    m = client.messages.create(model="rlx", max_tokens=64, system="You are a careful calculator "
                                               "agent.", messages=messages, tools=atools)
                    rtt.append(time.perf_counter() - t0)
                    use = [b for b in m.content if b.type == "tool_use"][0]
                    messages += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                               "content": "84"}]}]
                client.close()
            assert [t.kind for t in session.turns] == ["start"] + ["append"] * (args.turns - 1), session.turns
            adapter.close_session(session)
        server = list(adapter.overheads)
        results[api] = (server, rtt)
    background.__exit__(None, None, None)

    n = args.sessions * args.turns
    print(f"\n{args.sessions} sessions x {args.turns} turns per API (tool call -> tool result -> ...), "
          f"instant engine, tiny Qwen3 tokenizer, comparator {'off' if args.no_compare else 'on'}; "
          f"milliseconds per turn")
    print(f"{'':34}{'p50':>8}{'p90':>8}{'p99':>8}")
    for api, (server, rtt) in results.items():
        name = {"chat": "OpenAI chat", "messages": "Anthropic messages"}[api]
        for label, xs in (("adapter (engine excluded)", server), ("SDK round trip, loopback", rtt)):
            ms = [x * 1000 for x in xs]
            print(f"{name + ' ' + label:34}{pct(ms, 50):8.3f}{pct(ms, 90):8.3f}{pct(ms, 99):8.3f}")
    worst = max(pct([x * 1000 for x in s], 50) for s, _ in results.values())
    print(f"target: adapter p50 under 2 ms -> {worst:.3f} ms ({'met' if worst < 2 else 'NOT met'}); {n} turns each")


if __name__ == "__main__":
    main()
