"""Agent programs for tests/openai/test_constrained_logp_metric.py (`data.openai_agent=constrained_agents:<name>`),
written only against the official `openai` client."""

from __future__ import annotations

from openai import OpenAI

# a strict tool whose arguments close within a few tokens (a bounded integer), so an untrained model's forced call is
# complete well within its token limit
DIGIT = {"type": "function", "function": {
    "name": "digit", "strict": True,
    "parameters": {"type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["d"], "additionalProperties": False}}}


def forced_call_then_answer(item: dict, base_url: str, api_key: str) -> float:
    """A forced call of the strict tool (every token of it sampled under the call's grammar), its result, then a free
    answer (tool_choice none: no grammar): one trajectory holding both kinds of tokens."""
    c = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = list(item["messages"])
    first = c.chat.completions.create(model="policy", messages=messages, tools=[DIGIT], tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=100).choices[0].message
    call = first.tool_calls[0]
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    # the same tools (a call that changes them starts a new segment), none called: no grammar
    c.chat.completions.create(model="policy", messages=messages, tools=[DIGIT], tool_choice="none", max_tokens=6)
    return 1.0
