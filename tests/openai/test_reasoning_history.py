"""An earlier assistant message's `reasoning_content` reaches the chat template (`normalize_message`,
`ChatFormat.render`), as SGLang and vLLM pass it on: Qwen3's, Qwen3.5's and GLM-4.5's templates write the reasoning
of the turns after the last user message (a tool loop's), so the prompt of such a conversation is the template's own
`apply_chat_template` of it. In the gateway a new prompt (a new segment) is that render too, and an answer echoed back
with its reasoning_content still continues its session on the sampled tokens (the prefix property).

Negative control: before this change the reasoning was dropped (Qwen3: no <think> block at all; Qwen3.5 and GLM-4.5:
an empty one), so every render below differed from the template's.
"""

from __future__ import annotations

import copy
import json

import pytest

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.protocol import APIError, normalize_message
from tests.agents.templates import family_tokenizer
from tests.openai.scripted import ScriptedGateways

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
THOUGHT = "I need the weather tool for Paris."
CONVERSATION = [
    {"role": "system", "content": "Be helpful."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
FAMILIES = ("qwen3", "qwen3_5", "glm4_5")


def template_render(tok, messages: list[dict]) -> str:
    """The template's own render (transformers' convention: a call's arguments as a mapping)."""
    own = copy.deepcopy(messages)
    for m in own:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return tok.apply_chat_template(own, tools=TOOLS, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_render_keeps_the_reasoning_of_a_tool_loop_as_the_template_does(family):
    tok = family_tokenizer(family)
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    expected = template_render(tok, CONVERSATION)
    assert THOUGHT in expected  # the template writes it here (after the last user message)
    assert fmt.render([normalize_message(m) for m in CONVERSATION], TOOLS) == expected


def test_a_reasoning_content_that_is_not_text_is_a_400():
    bad = {**CONVERSATION[2], "reasoning_content": ["not", "text"]}
    with pytest.raises(APIError, match=r"messages\[2\].reasoning_content"):
        normalize_message(bad, "messages[2]")


def test_the_gateway_renders_it_in_a_new_prompt_and_keeps_continuity_when_echoed():
    tok = family_tokenizer("qwen3")
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    made = ScriptedGateways()
    try:
        # a new prompt (a session's first call) with the reasoning in its history: the template's render
        _, script, _, client = made.make(fmt, ["Sunny."])
        client.chat.completions.create(model="policy", messages=CONVERSATION, tools=TOOLS)
        assert script.calls[0][0]["input_ids"] == fmt.encode(template_render(tok, CONVERSATION))
        # an answer with reasoning and a call, echoed back with its reasoning_content (model_dump), then the tool's
        # result: the second prompt continues the first prompt and the sampled tokens
        call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
        answer = f"<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
        _, script, session, client = made.make(fmt, [answer, "Sunny."])
        user = CONVERSATION[:2]
        message = client.chat.completions.create(model="policy", messages=user, tools=TOOLS).choices[0].message
        echoed = message.model_dump(exclude_none=True)
        assert echoed["reasoning_content"] == THOUGHT and echoed["tool_calls"]
        follow = user + [echoed, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        client.chat.completions.create(model="policy", messages=follow, tools=TOOLS)
        first, second = script.calls[0][0]["input_ids"], script.calls[1][0]["input_ids"]
        assert second[:len(first) + len(script.ids(0))] == first + script.ids(0)
        assert session.segments == 1
    finally:
        made.close()
