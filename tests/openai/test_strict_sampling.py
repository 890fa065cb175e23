"""Strict function tools constrained while sampling (`relax.rollout.grammar.strict_calls`): with tool_choice auto and
a tool whose `strict` is true (what openai-agents sends for every function tool, LangChain's `bind_tools(strict=True)`),
the text stays free and every call the model opens is a call of a tool offered, a strict tool's arguments following
its schema, as OpenAI (and SGLang's structural tag for strict tools) guarantee.

relax-serve with the tiny random model and the official `openai` client: the byte-level vocabulary gets `<tool_call>`
and `</tool_call>` as tokens of their own (as Qwen's vocabulary has them), so the random model opens a call now and
then; without a strict tool (the negative control, the same request and seeds) those calls are random bytes, never
read as calls, and with one every call it opens comes back as tool_calls whose arguments validate. The training
gateway sends the same grammar to its engine: a scripted engine there, for each model family's tool-call format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import FAMILIES, _byte_level_tokenizer, family_tokenizer  # noqa: E402

from relax.rollout.grammar import Grammars, GrammarSpec  # noqa: E402
from relax.serve.openai.chat import ChatFormat  # noqa: E402
from tests.openai.scripted import ScriptedGateways  # noqa: E402
from tests.openai.serving import tiny_server  # noqa: E402

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["days", "unit"], "additionalProperties": False}


def weather(strict: bool, parameters: dict = WEATHER) -> dict:
    return {"type": "function", "function": {"name": "weather", "parameters": parameters, "strict": strict}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The official client on relax-serve: the tiny model, a byte-level vocabulary with the Hermes tags as tokens,
    ChatML (tools as Relax's Hermes system message, calls read by the hermes parser)."""
    from relax.data.tokenizer import CHATML_TEMPLATE

    tok = _byte_level_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = CHATML_TEMPLATE
    with tiny_server(tmp_path_factory.mktemp("tagged-bytes"), tok) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
@pytest.mark.xdist_group("serve_strict")
def test_the_calls_a_model_opens_follow_a_strict_tools_schema(client):
    """Eight choices of one request: without strict (the control) some open a call that is no call (random bytes
    after `<tool_call>`: the message comes back as text, no tool_calls); with strict every call opened comes back as
    a call whose arguments validate (a choice cut by max_tokens inside a call is the only exception: none here)."""
    kw = dict(model="tiny", messages=USER, n=8, seed=1, max_tokens=300)
    free = client.chat.completions.create(**kw, tools=[weather(False)]).choices
    broken = [c for c in free if "<tool_call>" in (c.message.content or "") and not c.message.tool_calls]
    assert len(broken) >= 2 and not any(c.message.tool_calls for c in free), [c.message.content for c in free]
    strict = client.chat.completions.create(**kw, tools=[weather(True)]).choices
    called = [c for c in strict if c.message.tool_calls]
    assert len(called) >= 3, [c.message.content for c in strict]
    for c in strict:
        assert "<tool_call>" not in (c.message.content or ""), c.message.content  # every call opened is a call
        assert c.finish_reason == ("tool_calls" if c.message.tool_calls else "stop") or c.finish_reason == "length"
        for call in c.message.tool_calls or ():
            assert call.function.name == "weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.slow
@pytest.mark.xdist_group("serve_strict")
def test_a_strict_schema_the_grammar_cannot_compile_is_a_400_naming_the_tool(client):
    """A look-behind pattern: a JSON schema (jsonschema and Python's re take it), which xgrammar cannot compile; the
    same tool without strict is answered (its arguments are not constrained)."""
    params = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?<=a)b"}}}
    tools = [weather(True), {"type": "function", "function": {"name": "lookup", "parameters": params}}]
    client.chat.completions.create(model="tiny", messages=USER, tools=tools, max_tokens=4, seed=1)
    tools[1]["function"]["strict"] = True
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=USER, tools=tools, max_tokens=4, seed=1)
    body = caught.value.body
    assert body["param"] == "tools[1].function.parameters" and "'lookup'" in body["message"], body
    assert "Lookbehind" in body["message"]


# ------------------------------------------------------------------------------------------------ the gateway
CALCULATOR = {"type": "function", "function": {"name": "calculator", "strict": True, "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
    "additionalProperties": False}}}
THOUGHT = "6 times 7.\n</think>\n\n"  # what an answer writes after a generation prompt that opened <think>


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_gateway_sends_the_strict_grammar_in_every_family_format(family):
    """Through the training gateway (a scripted engine): a chat request with a strict tool sends the grammar of
    `strict_calls` in the family's tool-call format (after the reasoning block where its template reasons), which
    takes the family's own call, the same call with an argument renamed (not in the schema), no; the call comes back
    as tool_calls. Without strict, the request is sent free (the control)."""
    call = FAMILIES[family].tool_call
    thought = THOUGHT if FAMILIES[family].prompt_part else ""
    tok = family_tokenizer(family)
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    gateways = ScriptedGateways()
    try:
        gw, script, session, client = gateways.make(fmt, [thought + call])
        r = client.chat.completions.create(model="policy", messages=USER, tools=[CALCULATOR], max_tokens=60)
        assert r.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == [
            ("calculator", {"expression": "6 * 7"})]
        sp = script.calls[0][0]["sampling_params"]
        kind = "ebnf" if family == "llama3_1" and not fmt.reasoning else "structural_tag"
        spec = GrammarSpec(kind, sp[kind])
        grammars = Grammars(tok, len(tok))

        def takes(text: str) -> bool:
            m = grammars.matcher(spec, [tok.eos_token_id])
            return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and m.accept(tok.eos_token_id)

        assert takes(thought + call) and takes(thought + "The answer is 42.")
        assert not takes(thought + call.replace("expression", "formula"))
        free = dict(CALCULATOR, function=dict(CALCULATOR["function"], strict=False))
        client.chat.completions.create(model="policy", messages=USER, tools=[free], max_tokens=60)
        grammars_sent = {"ebnf", "structural_tag", "json_schema", "regex"} & set(script.calls[1][0]["sampling_params"])
        # a template that takes one call per message (Llama 3.x) is held to one call even then
        # (test_single_call_templates.py)
        assert grammars_sent == ({kind} if fmt.single_call else set())
    finally:
        gateways.close()


def test_the_responses_route_sends_a_strict_tools_grammar():
    """The Responses API (openai-agents' default: every function tool strict) passes `strict` on to the chat route:
    the grammar is sent, and the call comes back as a function_call item; a tool that is not strict, no grammar."""
    tok = family_tokenizer("smollm2_chatml")
    gateways = ScriptedGateways()
    try:
        gw, script, session, client = gateways.make(ChatFormat(tok, (tok.eos_token_id,)),
                                                    [FAMILIES["smollm2_chatml"].tool_call])
        fn = {k: CALCULATOR["function"][k] for k in ("name", "parameters", "strict")}
        r = client.responses.create(model="policy", input="What is 6 * 7?", tools=[{"type": "function", **fn}],
                                    max_output_tokens=60)
        assert [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"] == [
            ("calculator", {"expression": "6 * 7"})]
        assert "structural_tag" in script.calls[0][0]["sampling_params"]
        client.responses.create(model="policy", input="What is 6 * 7?", max_output_tokens=60,
                                tools=[{"type": "function", **fn, "strict": False}])
        assert "structural_tag" not in script.calls[1][0]["sampling_params"]
    finally:
        gateways.close()
