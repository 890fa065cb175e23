"""Agent programs for tests/openai/test_reasoning_free.py (`data.openai_agent=reasoning_agents:<name>`), written only
against the official `openai` client."""

from __future__ import annotations

from openai import OpenAI

# a strict tool whose arguments close within a few tokens (constrained_agents.DIGIT)
DIGIT = {"type": "function", "function": {
    "name": "digit", "strict": True,
    "parameters": {"type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["d"], "additionalProperties": False}}}


def forced_call_after_reasoning(item: dict, base_url: str, api_key: str) -> float:
    """A forced call of a model whose prompt opens its `<think>` block (Qwen3.5): the answer reasons first (an
    untrained model's reasoning runs to the token limit), then a free answer (tool_choice none: no grammar)."""
    c = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = list(item["messages"])
    first = c.chat.completions.create(model="policy", messages=messages, tools=[DIGIT], tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=16).choices[0].message
    messages.append(first.model_dump(exclude_none=True))
    for call in first.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "7"})
    c.chat.completions.create(model="policy", messages=messages, tools=[DIGIT], tool_choice="none", max_tokens=6)
    return 1.0
