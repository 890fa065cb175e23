"""A forced answer (`tool_choice` "required") that max_tokens cut inside its first call: its grammar allowed calls
only, so no part of it is content. Chat, streamed and not, and the Responses API return no call markup: content ""
(OpenAI's for an answer with no text and no call), no tool calls, finish_reason "length" (Responses: status
incomplete, no output item, as OpenAI's answer cut before any text has no message item). The gateway runs over a
scripted engine answering the cut call (`tests.openai.scripted.CutEngine`), in every built-in call format's
family; openai-agents' chat model then raises its own "finish_reason='length' but produced no assistant text"
instead of taking the markup for the agent's final answer (what data.reward would have scored).

Negative control: before, the Responses answer had a message item of no text (the `output == []` assertions failed);
before that, the cut call came back as the answer's content (`'<tool_call>\\n{"name": "calculator", ...'`),
streamed and not, and as the Responses message's text; openai-agents' final_output was that markup.
"""

from __future__ import annotations

import asyncio

import pytest

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import FAMILIES, family_tokenizer
from tests.openai.scripted import CutEngine, limits

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
USER = [{"role": "user", "content": "What is 6 * 7?"}]
# every family whose answer starts with its call (Qwen3.5's generation prompt opens a <think> block first)
NAMES = [n for n, f in FAMILIES.items() if not f.prompt_part]


def cut_gateway(name: str):
    """A gateway whose engine answers the family's calculator call cut inside its argument, and a session's client."""
    tok = family_tokenizer(name)
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    call = FAMILIES[name].tool_call
    engine = CutEngine(fmt.encode(call[:call.index("6 * 7") + 2]))
    gw = Gateway(OpenAIService(fmt, engine.send, model="policy", context_length=None, max_tokens=64,
                               stream=engine.stream)).start()
    return gw, openai.OpenAI(base_url=gw.base_url, api_key=gw.open(0, limits()).key, max_retries=0)


@pytest.mark.parametrize("name", NAMES)
def test_a_forced_answer_cut_in_its_first_call_has_no_content(name):
    gw, client = cut_gateway(name)
    try:
        kw = dict(model="policy", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=64)
        choice = client.chat.completions.create(**kw).choices[0]
        # content "": OpenAI's for an answer with no text and no call (null is for calls only)
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("", None, "length")
        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        assert chunks[0].choices[0].delta.content == "" and chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
        assert not any(c.choices[0].delta.tool_calls for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        # Responses: no item at all, as OpenAI's answer cut before any text has no message item
        rkw = dict(model="policy", input="What is 6 * 7?", tool_choice="required",
                   tools=[{"type": "function", **TOOLS[0]["function"]}], max_output_tokens=64)
        resp = client.responses.create(**rkw)
        assert resp.status == "incomplete" and resp.output_text == "" and resp.output == [], resp.output
        events = list(client.responses.create(**rkw, stream=True))
        assert events[-1].type == "response.incomplete" and events[-1].response.output == []
        assert not [e for e in events if e.type == "response.output_item.added"]
    finally:
        gw.close()


def test_openai_agents_does_not_take_a_cut_call_for_the_answer():
    """openai-agents' chat model, tool_choice required, stop_on_first_tool: the cut answer is no final output (the
    SDK raises on an answer cut with no text; the training gateway keeps such a run as truncated,
    tests/openai/test_agent_cut_answers.py)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an expression."""
        return "42"

    gw, client = cut_gateway("qwen3")
    try:
        model = agents.OpenAIChatCompletionsModel("policy", openai.AsyncOpenAI(
            base_url=str(client.base_url), api_key=client.api_key, max_retries=0))
        agent = agents.Agent(name="a", tools=[calculator], model=model, tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(tool_choice="required"))
        with pytest.raises(agents.exceptions.ModelBehaviorError, match="length"):
            asyncio.run(agents.Runner.run(agent, "What is 6 * 7?"))
    finally:
        gw.close()
