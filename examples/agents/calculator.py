"""A tool-using agent written against the official `openai` SDK, trained by rlx unchanged.

rlx calls `agent(base_url, api_key, task)` once per sample; the SDK talks to rlx's OpenAI-compatible
adapter, which serves the policy from rlx's engines and records every turn token-in-token-out. The
agent gives the model a calculator tool, runs the tool calls it makes (at most `MAX_TURNS` model
turns), and returns a reward: the fraction of digit characters in the final answer (dense credit a
random tiny model can climb), plus 1 if the answer is right, plus 0.5 for a well-formed tool call.
"""

from __future__ import annotations

import ast
import json
import operator

import openai

MAX_TURNS = 3
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """A safe evaluator: numbers and + - * only (no names, no calls)."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * are allowed")
    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (ValueError, SyntaxError) as e:
        return f"error: {e}"


def digit_fraction(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


async def agent(base_url: str, api_key: str, task: dict) -> float:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    bonus = 0.0
    answer = ""
    for _ in range(MAX_TURNS):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=24)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            answer = msg.content or ""
            break
        for call in msg.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = calculate(str(args.get("expression", "")))
                bonus = 0.5
            except (ValueError, AttributeError):
                result = "error: arguments must be JSON with an expression"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    await client.close()
    right = answer.strip() == str(task["label"]).strip()
    return digit_fraction(answer) + float(right) + bonus
