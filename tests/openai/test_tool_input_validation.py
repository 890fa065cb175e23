"""Bad tool definitions and bad history tool calls are a 400 in OpenAI's error shape naming the field, the same on
every model family, on relax-serve and the training gateway, on Chat Completions and the Responses API, before the
chat template renders anything and before anything is generated (`relax.serve.openai.protocol.check_function`,
`check_tool_names`, `call_arguments`):

- a tool's `parameters` that is not an object (OpenAI: "Invalid type for 'tools[0].function.parameters': expected an
  object"), or not a JSON Schema by its metaschema, or of a type other than object (OpenAI: "Invalid schema for
  function ..."), strict or not;
- a tool name outside OpenAI's `^[a-zA-Z0-9_-]{1,64}$`, and two tools of one name;
- `tool_choice` or `parallel_tool_calls` without tools on Chat Completions (OpenAI's "'tool_choice' is only allowed
  when 'tools' are specified"); the Responses API echoes both on every response, and takes "auto"/"none" and
  parallel_tool_calls without tools (they change nothing);
- `tools: []` on Chat Completions (OpenAI's "[] is too short - 'tools'"), while the Responses API takes it as no tools
  (as OpenAI's does: openai-agents sends `tools: []` on every Responses call of an agent without tools);
- a history call's `arguments` that is not a JSON object string ("{not json", "[1, 2]", "5"): refused on every
  family (docs/agents.md, 'Tool calls in the history'): every call format Relax writes history in holds an object,
  and the model's own tool parser reads nothing else back as a call; and one given as a JSON object instead of a
  string (OpenAI's "Invalid type ...: expected a string", `code` `invalid_type`: its schema's type, which the SDKs
  send); one without `arguments` (OpenAI's "Missing required parameter", `missing_required_parameter`) or with null
  (`invalid_type`), on the Responses API too (`input[i].arguments`), while the empty string, which OpenAI's schema
  takes (a string without a minimum length; its own answers hold "" for a strict function without parameters), is
  read as no arguments.

The matrix runs the service itself (`OpenAIService.chat`, `Responses.create`) over each fixture family's tokenizer
with a scripted engine that records what it is asked; the official `openai` client checks each route over HTTP.
Negative control, the code before: the parameters cases were a 500 (AttributeError) on ChatML, DeepSeek-V3 and the
XML families, 200 with the string in the prompt on Qwen3/GLM/gpt-oss, or a 400 naming tool_choice or
parallel_tool_calls; the arguments cases a 500 (JSONDecodeError, TypeError) on ChatML, Qwen3-Coder, Qwen3.5, a
"template refuses" 400 on GLM-4.5, and 200 elsewhere; names, duplicates and the tool-less options 200; `tools: []` on
Chat Completions 200 (taken as no tools); history arguments given as an object 200 on chat (rendered), a 400 naming
`input[1]` rather than its `arguments` on Responses; history arguments missing or null 200 on chat (taken as {}),
a 400 naming `input[1]` rather than its `arguments` on Responses.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.protocol import APIError
from relax.serve.openai.responses import Responses
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import FAMILIES, family_tokenizer, gpt_oss_tokenizer
from tests.openai.scripted import Script

openai = pytest.importorskip("openai")

PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
ARGS_AT = "messages[2].tool_calls[0].function.arguments"


def _tool(**fn) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS, **fn}}


MISSING = object()  # a history call without the "arguments" key


def _history(args: Any) -> list[dict]:
    fn = {"name": "get_weather"} if args is MISSING else {"name": "get_weather", "arguments": args}
    return START + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                          "function": fn}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "1"}]


# name -> (chat request fields, the param its 400 names)
BAD_CHAT = {
    "parameters a string": (dict(tools=[_tool(parameters="abc")]), "tools[0].function.parameters"),
    "parameters a list": (dict(tools=[_tool(parameters=[1])]), "tools[0].function.parameters"),
    "parameters a string, forced": (dict(tools=[_tool(parameters="abc")], tool_choice="required"),
                                    "tools[0].function.parameters"),
    "parameters a string, parallel off": (dict(tools=[_tool(parameters="abc")], parallel_tool_calls=False),
                                          "tools[0].function.parameters"),
    "parameters of a second tool a number": (dict(tools=[TOOL, _tool(name="other", parameters=5)]),
                                             "tools[1].function.parameters"),
    "properties a string": (dict(tools=[_tool(parameters={"type": "object", "properties": "abc"})]),
                            "tools[0].function.parameters"),
    "properties a list, forced": (dict(tools=[_tool(parameters={"type": "object", "properties": [1]})],
                                       tool_choice="required"), "tools[0].function.parameters"),
    "a property's schema a string": (dict(tools=[_tool(parameters={"type": "object", "properties": {"a": "x"}})]),
                                     "tools[0].function.parameters"),
    "required a string, parallel off": (dict(tools=[_tool(parameters={**PARAMS, "required": "a"})],
                                             parallel_tool_calls=False), "tools[0].function.parameters"),
    "an unknown type, named": (dict(tools=[_tool(parameters={"type": "bogus"})],
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                               "tools[0].function.parameters"),
    "a string schema": (dict(tools=[_tool(parameters={"type": "string"})]), "tools[0].function.parameters"),
    "name with a space": (dict(tools=[_tool(name="get weather")]), "tools[0].function.name"),
    "name with a quote": (dict(tools=[_tool(name='get"weather')]), "tools[0].function.name"),
    "name of 65 characters": (dict(tools=[_tool(name="a" * 65)]), "tools[0].function.name"),
    "two tools of one name": (dict(tools=[TOOL, TOOL]), "tools"),
    "tool_choice none without tools": (dict(tool_choice="none"), "tool_choice"),
    "tool_choice auto without tools": (dict(tool_choice="auto"), "tool_choice"),
    "tools an empty list": (dict(tools=[]), "tools"),  # OpenAI: "[] is too short - 'tools'"
    "tools an empty list, tool_choice required": (dict(tools=[], tool_choice="required"), "tools"),
    "tool_choice required without tools": (dict(tool_choice="required"), "tool_choice"),
    "parallel_tool_calls without tools": (dict(parallel_tool_calls=False), "parallel_tool_calls"),
    "history arguments not JSON": (dict(messages=_history("{not json"), tools=[TOOL]), ARGS_AT),
    "history arguments a JSON list": (dict(messages=_history("[1, 2]"), tools=[TOOL]), ARGS_AT),
    "history arguments a JSON number": (dict(messages=_history("5"), tools=[TOOL]), ARGS_AT),
    "history arguments a JSON string": (dict(messages=_history('"a"'), tools=[TOOL]), ARGS_AT),
    # OpenAI's schema: a string, which every SDK sends (langchain-openai json.dumps the args)
    "history arguments an object, not a string": (dict(messages=_history({"a": 17}), tools=[TOOL]), ARGS_AT),
    "history arguments an empty object, not a string": (dict(messages=_history({}), tools=[TOOL]), ARGS_AT),
    # OpenAI's schema: a required string ("Missing required parameter", and null "expected a string")
    "history arguments missing": (dict(messages=_history(MISSING), tools=[TOOL]), ARGS_AT),
    "history arguments null": (dict(messages=_history(None), tools=[TOOL]), ARGS_AT),
}
# the same requests' valid twins, answered on every family (the prompt rendered, a call generated)
GOOD_CHAT = {
    "parameters an object": dict(tools=[TOOL]),
    "no parameters": dict(tools=[{"type": "function", "function": {"name": "get-weather_2"}}]),
    "name of 64 characters": dict(tools=[_tool(name="a" * 64)]),
    # what pydantic and the SDKs write: $defs and $ref, anyOf with null, enum, default, no "type" at the top
    "a pydantic-style schema": dict(tools=[_tool(parameters={
        "$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}},
        "properties": {"city": {"type": "string"}, "unit": {"anyOf": [{"$ref": "#/$defs/Unit"}, {"type": "null"}],
                                                            "default": None}},
        "required": ["city"], "additionalProperties": False})], tool_choice="required"),
    "history arguments an object": dict(messages=_history('{"a": 17}'), tools=[TOOL]),
    "history arguments empty": dict(messages=_history(""), tools=[TOOL]),
}

R_TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS}
R_INPUT = [{"role": "user", "content": "hi"}]


def _r_history(args: Any) -> list[dict]:
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather"}
    return R_INPUT + [call if args is MISSING else {**call, "arguments": args},
                      {"type": "function_call_output", "call_id": "c1", "output": "1"}]


BAD_RESPONSES = {
    "parameters a string": (dict(tools=[{**R_TOOL, "parameters": "abc"}]), "tools[0].parameters"),
    "parameters a list, forced": (dict(tools=[{**R_TOOL, "parameters": [1]}], tool_choice="required"),
                                  "tools[0].parameters"),
    "properties a string": (dict(tools=[{**R_TOOL, "parameters": {"type": "object", "properties": "abc"}}]),
                            "tools[0].parameters"),
    "name with a space": (dict(tools=[{**R_TOOL, "name": "get weather"}]), "tools[0].name"),
    "two tools of one name": (dict(tools=[R_TOOL, R_TOOL]), "tools"),
    "tool_choice required without tools": (dict(tool_choice="required"), "tool_choice"),
    "history arguments not JSON": (dict(input=_r_history("{not json")), "input[1].arguments"),
    "history arguments a JSON list": (dict(input=_r_history("[1, 2]"), tools=[R_TOOL]), "input[1].arguments"),
    "history arguments an object, not a string": (dict(input=_r_history({"a": 17}), tools=[R_TOOL]),
                                                   "input[1].arguments"),
    "history arguments missing": (dict(input=_r_history(MISSING), tools=[R_TOOL]), "input[1].arguments"),
    "history arguments null": (dict(input=_r_history(None), tools=[R_TOOL]), "input[1].arguments"),
}
GOOD_RESPONSES = {
    "tool_choice auto without tools": dict(tool_choice="auto"),
    "tool_choice none without tools": dict(tool_choice="none"),
    "parallel_tool_calls without tools": dict(parallel_tool_calls=False),
    # the Responses API takes an empty list (openai-agents sends tools=[] on every call of an agent without tools)
    "tools an empty list": dict(tools=[]),
    "tools an empty list, tool_choice auto": dict(tools=[], tool_choice="auto", parallel_tool_calls=True),
    "history arguments an object": dict(input=_r_history('{"a": 17}'), tools=[R_TOOL]),
    "history arguments empty": dict(input=_r_history(""), tools=[R_TOOL]),  # a string: OpenAI's schema takes it
}

FAMILY_NAMES = [*FAMILIES, "gpt_oss"]


@pytest.fixture(scope="module")
def formats() -> dict[str, ChatFormat]:
    out = {}
    for name in FAMILY_NAMES:
        tok = gpt_oss_tokenizer() if name == "gpt_oss" else family_tokenizer(name)
        out[name] = ChatFormat(tok, (tok.eos_token_id,))
    return out


def _refusal(call) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    return info.value


def test_chat_refusals_are_the_same_400_on_every_family_before_rendering(formats):
    for case, (fields, param) in BAD_CHAT.items():
        seen = set()
        for name, fmt in formats.items():
            script = Script(fmt, ["ok"])
            service = OpenAIService(fmt, script, model="m", context_length=None, max_tokens=8)
            exc = _refusal(lambda s=service, f=fields: s.chat({"model": "m", "messages": START, "max_tokens": 4, **f}))
            assert (exc.status, exc.param, exc.kind) == (400, param, "invalid_request_error"), (case, name, exc)
            assert f"'{param}'" in str(exc), (case, name, str(exc))
            assert script.calls == [], (case, name)  # nothing generated
            seen.add(str(exc))
        assert len(seen) == 1, (case, seen)  # one message, whatever the family


def test_the_valid_twins_render_and_generate_on_every_family(formats):
    for case, fields in GOOD_CHAT.items():
        for name, fmt in formats.items():
            script = Script(fmt, ["ok"])
            service = OpenAIService(fmt, script, model="m", context_length=None, max_tokens=8)
            status, answer = service.chat({"model": "m", "messages": START, "max_tokens": 4, **fields})
            assert status == 200 and len(script.calls) == 1, (case, name)
            prompt = fmt.tokenizer.decode(script.calls[0][0]["input_ids"])
            tool = fields["tools"][0]["function"]["name"]
            assert tool in prompt, (case, name, prompt)
            if "17" in json.dumps(fields.get("messages", [])):  # the history call's argument is in the prompt
                assert "17" in prompt, (case, name, prompt)


def test_responses_refusals_are_the_same_400_on_every_family(formats):
    for case, (fields, param) in BAD_RESPONSES.items():
        seen = set()
        for name, fmt in formats.items():
            script = Script(fmt, ["ok"])
            responses = Responses(OpenAIService(fmt, script, model="m", context_length=None, max_tokens=8))
            body = {"model": "m", "input": R_INPUT, "max_output_tokens": 4, **fields}
            exc = _refusal(lambda r=responses, b=body: r.create(b))
            assert (exc.status, exc.param) == (400, param), (case, name, exc)
            assert param in str(exc) and script.calls == [], (case, name, str(exc))
            seen.add(str(exc))
        assert len(seen) == 1, (case, seen)
    for case, fields in GOOD_RESPONSES.items():
        for name, fmt in formats.items():
            script = Script(fmt, ["ok"])
            responses = Responses(OpenAIService(fmt, script, model="m", context_length=None, max_tokens=8))
            status, _ = responses.create({"model": "m", "input": R_INPUT, "max_output_tokens": 4, **fields})
            assert status == 200 and len(script.calls) == 1, (case, name)


# ------------------------------------------------------------------------------------------------- over HTTP
def _bad_request(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value


def _check_routes(client) -> None:
    """Every route's refusals through the official client: a 400 (not a 500 the client retries), the field named."""
    chat = {"model": "policy", "messages": START, "max_tokens": 4}
    for fields, param in (BAD_CHAT["parameters a string"], BAD_CHAT["history arguments not JSON"],
                          BAD_CHAT["name with a space"], BAD_CHAT["tool_choice none without tools"],
                          BAD_CHAT["tools an empty list"], BAD_CHAT["history arguments an object, not a string"],
                          BAD_CHAT["history arguments missing"], BAD_CHAT["history arguments null"]):
        exc = _bad_request(lambda f=fields: client.chat.completions.create(**{**chat, **f}))
        assert exc.status_code == 400 and exc.body["param"] == param and exc.body["type"] == "invalid_request_error"
        assert f"'{param}'" in exc.body["message"], exc.body
    for fields, code in ((BAD_CHAT["history arguments missing"][0], "missing_required_parameter"),
                         (BAD_CHAT["history arguments null"][0], "invalid_type")):  # OpenAI's codes for the two
        assert _bad_request(lambda f=fields: client.chat.completions.create(**{**chat, **f})).code == code
    for fields, param in (BAD_RESPONSES["parameters a string"], BAD_RESPONSES["history arguments a JSON list"],
                          BAD_RESPONSES["two tools of one name"], BAD_RESPONSES["history arguments missing"]):
        exc = _bad_request(lambda f=fields: client.responses.create(
            **{"model": "policy", "input": R_INPUT, "max_output_tokens": 16, **f}))
        assert exc.status_code == 400 and exc.body["param"] == param, exc.body


def test_relax_serve_routes_over_http(tmp_path):
    from tests.openai.serving import tiny_server

    with tiny_server(tmp_path, family_tokenizer("qwen3_coder")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        _check_routes(client)
        # the control: empty arguments (a string, as OpenAI's schema has it) are no arguments, on both routes
        client.chat.completions.create(model="policy", messages=_history(""), tools=[TOOL], max_tokens=4)
        client.responses.create(model="policy", input=_r_history(""), tools=[R_TOOL], max_output_tokens=16)


def test_gateway_routes_over_http(gateways, formats):
    for name in ("smollm2_chatml", "glm4_5"):
        _, script, _, client = gateways.make(formats[name], ["ok"])
        _check_routes(client)
        assert script.calls == []
        # the control: the valid twin is answered in the session
        answer = client.chat.completions.create(model="policy", messages=_history('{"a": 17}'), tools=[TOOL])
        assert answer.choices[0].message.content == "ok" and len(script.calls) == 1
