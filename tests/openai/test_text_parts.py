"""Messages whose content is a list of text parts (a tool returning several texts: openai-agents'
`[ToolOutputText("sunny"), ToolOutputText("warm")]`; LangChain's content blocks; a Responses message with several
`input_text` parts) are rendered with the parts joined by newlines, as vLLM joins them for a template that reads
content as a string (`relax.serve.openai.protocol._text`, `relax.serve.openai.responses._content`). Checked on the
prompt the gateway sends the engine (a scripted one), through the official openai client. Negative control: before,
the parts were joined with nothing ("sunnywarm")."""

from __future__ import annotations

import pytest

from relax.serve.openai.chat import ChatFormat
from tests.agents.templates import family_tokenizer

pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def test_text_parts_are_joined_by_newlines(scripted_gateway):
    tok = family_tokenizer("qwen3")
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    _, script, _, client = scripted_gateway(fmt, ["Fine."])
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "Paris."}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"},
                                                                   {"type": "text", "text": "warm"}]}]
    client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    client.responses.create(model="policy", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Weather?"}, {"type": "input_text", "text": "Rome."}]}])
    chat, responses = (tok.decode(p["input_ids"]) for p, _ in script.calls)
    assert "Weather?\nParis." in chat and "sunny\nwarm" in chat and "sunnywarm" not in chat
    assert "Weather?\nRome." in responses
