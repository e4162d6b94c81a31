"""Prefill of a coding-agent harness's prompt in the embedded engine: the first turn (all ~60k tokens) and the
second (the first turn's prompt and answer, then a tool result), with the prefix cache and without it, beside a
plain transformers forward of the same tokens.

A harness such as Claude Code sends tens of thousands of characters of instructions and tool schemas on every
request; an engine that prefills them in minutes makes the harness time out, and one without a prefix cache pays
the whole prompt again every turn. The prompt here is harness-shaped: a system prompt of English prose (this
repository's Markdown) and 24 tools with JSON schemas, through the model's chat template, grown to `--tokens`.
`--request FILE` takes a captured Anthropic Messages body instead (its `system`, `messages` and `tools`).

    scripts/loopback .venv/bin/python benchmarks/harness_prefill.py [--tokens 60000] [--model builtin://tiny-qwen3-code]

Each figure is the median of `--repeats` runs; the engines run one after the other, never at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ["Bash", "Read", "Write", "Edit", "MultiEdit", "Glob", "Grep", "LS", "NotebookRead", "NotebookEdit",
         "WebFetch", "WebSearch", "TodoRead", "TodoWrite", "Task", "ExitPlanMode", "BashOutput", "KillShell",
         "SlashCommand", "ListMcpResources", "ReadMcpResource", "ApplyPatch", "UpdatePlan", "ViewImage"]


def prose() -> list[str]:
    """Paragraphs of English from this repository's Markdown, in a fixed order."""
    paras = []
    for md in sorted(ROOT.glob("**/*.md")):
        if ".venv" in md.parts or "node_modules" in md.parts:
            continue
        paras += [p.strip() for p in md.read_text(errors="replace").split("\n\n") if len(p.strip()) > 80]
    return paras


def synthetic_request(tok, tokens: int) -> tuple[list[dict], list[dict]]:
    """Messages and tools shaped like a harness's first request, about `tokens` tokens through the template."""
    paras = prose()
    tools = []
    for i, name in enumerate(TOOLS):
        props = {f"arg{j}": {"type": ["string", "number", "boolean"][j % 3], "description": paras[(i * 5 + j) % len(paras)][:300]}
                 for j in range(4)}
        tools.append({"type": "function", "function": {"name": name, "description": paras[(i * 7) % len(paras)],
                                                        "parameters": {"type": "object", "properties": props,
                                                                       "required": ["arg0"]}}})
    user = {"role": "user", "content": "The test in tests/test_parse.py fails. Find the bug and fix it."}
    system, i = [], 0
    base = len(render(tok, [{"role": "system", "content": ""}, user], tools))
    total = base
    while total < tokens:  # paragraphs until the prompt reaches `tokens` (each counted alone: close enough)
        para = paras[i % len(paras)]
        system.append(para)
        total += len(tok.encode("\n\n" + para, add_special_tokens=False))
        i += 1
    return [{"role": "system", "content": "\n\n".join(system)}, user], tools


def render(tok, messages: list[dict], tools: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def captured_request(path: Path) -> tuple[list[dict], list[dict]]:
    """An Anthropic Messages body as the chat template's messages and tools (text only)."""
    body = json.loads(path.read_text())

    def text(content) -> str:
        if isinstance(content, str):
            return content
        return "\n".join(b.get("text", "") if b.get("type") == "text" else json.dumps(b) for b in content)

    system = body.get("system") or ""
    messages = [{"role": "system", "content": text(system)}] if system else []
    messages += [{"role": m["role"], "content": text(m["content"])} for m in body["messages"]]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                               "parameters": t.get("input_schema", {})}}
             for t in body.get("tools", []) if "name" in t]
    return messages, tools


async def timed(client, ids: list[int], new_tokens: int) -> tuple[float, int, list[int]]:
    from rlx.rollout.engines.client import GenerateRequest

    t = time.perf_counter()
    (r,) = await client.generate(GenerateRequest(ids, {"max_new_tokens": new_tokens, "temperature": 1.0,
                                                       "ignore_eos": True}))
    return time.perf_counter() - t, r.cached_tokens, r.output_ids


def engine_figures(path: str, turn1: list[int], tail: list[int], threads: int, repeats: int, cache: bool,
                   answer: int) -> dict[str, float]:
    """Median seconds of turn 1 and turn 2 (each from an emptied cache, turn 2 right after its turn 1)."""
    from rlx.rollout.engines.launch import ManagedProcess, embedded_command, free_port, wait_healthy
    from rlx.rollout.engines.client import EngineClient

    port = free_port()
    args = {"num_threads": threads, "context_length": len(turn1) + answer + len(tail) + 64}
    if not cache:
        args["disable_radix_cache"] = True
    proc = ManagedProcess(embedded_command(path, port, server_args=args), Path("/tmp") / f"rlx-bench-prefill-{port}.log")
    proc.start()
    out: dict[str, list[float]] = {"turn1": [], "turn2": [], "cached2": []}

    async def measure(url: str) -> None:
        async with EngineClient(url) as client:
            for _ in range(repeats):
                await client.request("POST", "/flush_cache")
                s1, _, answer_ids = await timed(client, turn1, answer)
                s2, cached, _ = await timed(client, turn1 + answer_ids + tail, 1)
                out["turn1"].append(s1)
                out["turn2"].append(s2)
                out["cached2"].append(cached)

    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(url, proc, 300))
        asyncio.run(measure(url))
    finally:
        proc.stop()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin://tiny-qwen3-code")
    ap.add_argument("--tokens", type=int, default=60000, help="first-turn prompt tokens (synthetic prompt)")
    ap.add_argument("--request", type=Path, help="a captured Anthropic Messages request body (JSON) instead")
    ap.add_argument("--answer", type=int, default=32, help="tokens the first turn generates")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.models.tiny import resolve_model_path

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    messages, tools = captured_request(args.request) if args.request else synthetic_request(tok, args.tokens)
    t = time.perf_counter()
    turn1 = render(tok, messages, tools)
    template_s = time.perf_counter() - t
    chars = len(json.dumps(messages)) + len(json.dumps(tools))
    result = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n" + "\n".join(prose()[:6]) + "\n</tool_response>"
              "<|im_end|>\n<|im_start|>assistant\n")
    tail = tok.encode(result, add_special_tokens=False)

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf = []
    with torch.no_grad():
        for _ in range(args.repeats):
            s = time.perf_counter()
            model(input_ids=torch.tensor([turn1]), use_cache=True, logits_to_keep=1)
            hf.append(time.perf_counter() - s)
    del model
    cached = engine_figures(path, turn1, tail, args.threads, args.repeats, True, args.answer)
    plain = engine_figures(path, turn1, tail, args.threads, args.repeats, False, args.answer)

    print(f"model {args.model}, {args.threads} threads, {'captured ' + str(args.request) if args.request else 'synthetic'}"
          f" prompt: {len(turn1)} tokens from {chars} characters ({chars / len(turn1):.2f} chars/token); chat "
          f"template {template_s:.2f} s; turn 2 adds {args.answer} answer + {len(tail)} tool-result tokens; medians of "
          f"{args.repeats}")
    print(f"{'':<34} | {'turn 1 (s)':>10} | {'turn 2 (s)':>10} | {'turn 2 cached tokens':>20}")
    print(f"{'rlx engine, prefix cache':<34} | {cached['turn1']:>10.2f} | {cached['turn2']:>10.2f} | "
          f"{cached['cached2']:>20.0f}")
    print(f"{'rlx engine, --disable-radix-cache':<34} | {plain['turn1']:>10.2f} | {plain['turn2']:>10.2f} | "
          f"{plain['cached2']:>20.0f}")
    print(f"{'transformers forward (prefill only)':<34} | {statistics.median(hf):>10.2f} | {'':>10} | {'':>20}")


if __name__ == "__main__":
    main()
