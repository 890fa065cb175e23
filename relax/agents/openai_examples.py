"""Agent programs written only against the official `openai` client: examples of `data.openai_agent`
(docs/agents.md). Each is `run(item, base_url, api_key) -> reward or None`: it talks to the model through the
training gateway like to any OpenAI-compatible endpoint, and returns None to let `data.reward` score its final
answer. Nothing here imports Relax: an agent you already have works the same way once it takes its `base_url` and
`api_key` from the arguments.

- `plan_then_answer`: two calls, a plan and then the answer (`rollout.max_turns=2`); any data.
- `calculator_agent`: a tool loop with an arithmetic calculator, for `data=calculator` with an instruct model
  (`model=smollm2_135m`); the tool runs inside the agent.
"""

from __future__ import annotations

import ast
import json
import operator

from openai import OpenAI

ANSWER = "Put the final answer in \\boxed{}."  # words the tiny model's vocabulary has
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def _client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=600)


def plan_then_answer(item: dict, base_url: str, api_key: str) -> None:
    """Ask the question, then ask for the final answer after the model's first reply."""
    client = _client(base_url, api_key)
    messages = list(item["messages"])
    plan = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    messages += [{"role": "assistant", "content": plan.content or ""}, {"role": "user", "content": ANSWER}]
    client.chat.completions.create(model="policy", messages=messages)
    return None


def _calculate(expression: str) -> str:
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression {expression!r}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"Error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def calculator_agent(item: dict, base_url: str, api_key: str, max_calls: int = 3) -> None:
    """Answer with the calculator tool: each tool call runs here and its result goes back as a tool message, until
    the model answers without calling it (or `max_calls` model calls were made)."""
    client = _client(base_url, api_key)
    messages = list(item["messages"])
    for _ in range(max_calls):
        message = client.chat.completions.create(model="policy", messages=messages,
                                                 tools=[CALCULATOR]).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments).get("expression", ""))
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _calculate(expression)})
    return None
