"""`strict` function tools through the gateway, with the official `openai` client against a scripted engine: a call
whose arguments do not satisfy a strict tool's schema is a malformed call (the answer stays text, no tool_calls),
the same call of a tool that is not strict is a call; a strict tool whose parameters are not a JSON schema is a 400
naming it."""

from __future__ import annotations

import json

import openai
import pytest
from test_gateway_branches import Engine

from relax.data.tokenizer import build_tiny_tokenizer
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.service import OpenAIService
from relax.serve.openai.sessions import Limits

USER = [{"role": "user", "content": "add one and two"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}


def tool(strict: bool, parameters: dict = SCHEMA) -> dict:
    return {"type": "function", "function": {"name": "add", "parameters": parameters, "strict": strict}}


def call_text(arguments: dict) -> str:
    return '<tool_call>{"name": "add", "arguments": ' + json.dumps(arguments) + "}</tool_call>"


@pytest.fixture
def make():
    """make(arguments) -> (engine, client): a gateway session whose engine answers every call with a Hermes call of
    add(**arguments) (one added token of the tiny vocabulary spells it)."""
    made = []

    def build(arguments: dict = {"a": 1, "b": 2}):  # noqa: B006 (read only)
        tok = build_tiny_tokenizer()
        tok.add_tokens([call_text(arguments)])
        fmt = ChatFormat(tok, (tok.eos_token_id,))
        engine = Engine(fmt, lambda text: call_text(arguments), lambda text: 0.0)
        gw = Gateway(OpenAIService(fmt, engine, model="policy", context_length=None, max_tokens=64)).start()
        made.append(gw)
        session = gw.open(0, Limits(max_calls=8, max_tokens=400, max_new_tokens=64, temperature=1.0, top_p=1.0,
                                    top_k=-1, seed=0))
        return engine, openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)

    yield build
    for gw in made:
        gw.close()


@pytest.mark.parametrize("arguments", [{"a": "one", "b": 2}, {"a": 1}])
def test_a_call_breaking_a_strict_schema_stays_text(make, arguments):
    engine, client = make(arguments)
    strict = client.chat.completions.create(model="m", messages=USER, tools=[tool(True)]).choices[0]
    assert strict.message.tool_calls is None and strict.finish_reason == "stop"
    assert strict.message.content == call_text(arguments)
    loose = client.chat.completions.create(model="m", messages=USER, tools=[tool(False)]).choices[0]
    assert loose.finish_reason == "tool_calls"
    assert json.loads(loose.message.tool_calls[0].function.arguments) == arguments


def test_a_call_satisfying_a_strict_schema_is_a_call(make):
    engine, client = make({"a": 1, "b": 2})
    choice = client.chat.completions.create(model="m", messages=USER, tools=[tool(True)]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "add"


def test_a_strict_tool_needs_a_schema(make):
    engine, client = make()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=USER, tools=[tool(True, {"type": 5})])
    assert caught.value.body["param"] == "tools[0].function.parameters"
    assert engine.calls == []  # refused before the engine ran
