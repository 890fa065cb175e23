"""OpenAI's rules on the parts of a request that Relax holds as OpenAI does (the API reference and the `openai`
package's request types), through the official `openai` client over real HTTP to the training gateway (a scripted
engine, fast; relax-serve parses requests with the same functions) and, for images, relax-serve's service with a
vision-language model in-process (`OpenAIService(images=True)`), each refusal a 400 in OpenAI's error shape naming
the field:

- a history tool call without `type` (`ChatCompletionMessageFunctionToolCallParam`: required, "function"):
  `messages[i].tool_calls[j].type`, `missing_required_parameter`;
- a history tool call without a string `id` (required: the tool message names it): `messages[i].tool_calls[j].id`,
  `missing_required_parameter` (absent, null) or `invalid_type`;
- an image part in a system, developer, tool or assistant message (their content parts are text only; an assistant's
  refusal part too, which Relax does not render): `messages[i].content[j].type`, `invalid_value`, on a
  vision-language model too;
- a history call's `arguments` of whitespace only: not JSON, refused as any text that is not a JSON object is
  (`messages[i].tool_calls[j].function.arguments`, `input[i].arguments`); the empty string stays no arguments;
- a Responses `function_call` item without `name` or `call_id`: `input[i].name` / `input[i].call_id`,
  `missing_required_parameter`;
- a json_schema format's `name` outside OpenAI's pattern (a-z, A-Z, 0-9, `_`, `-`; at most 64):
  `invalid_value` / `string_above_max_length`;
- `prompt_cache_options` that is not an object (`invalid_type`), with a key OpenAI does not define there, or
  Responses' `prewarm` true (generate nothing).

What the SDKs send by default passes each rule (the controls): the openai package's `parse` (a Pydantic model's name),
openai-agents' Chat Completions converter (history calls with their type and id, system messages as text, a tool
output's text parts only) and its `final_output` format, LangChain's history calls and structured output. LangChain's
history call built without an id is sent with a null id, which OpenAI refuses too: it gets the same 400.
Negative control: on the code before, each refusal was answered (200) or named another field (`input[1]`,
`messages[i].content[j]`).
"""

from __future__ import annotations

import json

import pytest

from tests.openai import request_rules
from tests.openai.request_rules import ANSWER, Answer, refused

client = request_rules.client  # the shared fixture, which pytest finds under this module's name

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_x", "parameters": {"type": "object", "properties": {}}}}
R_TOOL = {"type": "function", "name": "get_x", "parameters": {"type": "object", "properties": {}}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def _history(call: dict, args: str = "{}") -> list[dict]:
    return [{"role": "user", "content": "x?"},
            {"role": "assistant", "content": None, "tool_calls": [{**call, "function": {"name": "get_x",
                                                                                        "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"}]


def test_a_history_tool_call_needs_its_type(client):
    refused(lambda: client.chat.completions.create(model="m", messages=_history({"id": "c1"}), tools=[TOOL]),
            "messages[1].tool_calls[0].type", "missing_required_parameter")
    refused(lambda: client.chat.completions.create(model="m", messages=_history({"id": "c1", "type": None}),
                                                   tools=[TOOL]), "messages[1].tool_calls[0].type")
    # controls: with its type, as the SDKs write history calls
    assert client.chat.completions.create(model="m", messages=_history({"id": "c1", "type": "function"}),
                                          tools=[TOOL]).choices[0].message.content == ANSWER
    from agents.models.chatcmpl_converter import Converter

    items = [{"role": "user", "content": "x?"},
             {"type": "function_call", "call_id": "c1", "name": "get_x", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "1"}]
    messages = Converter.items_to_messages(items)
    assert messages[1]["tool_calls"][0]["type"] == "function"
    assert client.chat.completions.create(model="m", messages=messages, tools=[TOOL]).choices
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="m", base_url=client.gateway.base_url, api_key=client.api_key, max_retries=0)
    history = ["x?", AIMessage("", tool_calls=[{"id": "c1", "name": "get_x", "args": {}}]),
               ToolMessage("1", tool_call_id="c1")]
    assert llm.bind_tools([TOOL]).invoke(history).content == ANSWER


def _vl_service(smol, answer: str):
    from relax.serve.openai.service import OpenAIService
    from tests.openai.scripted import Script

    return OpenAIService(smol, Script(smol, [answer]), model="vl", context_length=None, max_tokens=8, images=True)


@pytest.mark.parametrize("role", ["system", "developer"])
def test_an_image_in_a_system_or_developer_message_is_refused(client, smol, role):
    from relax.serve.openai.protocol import APIError

    messages = [{"role": role, "content": [{"type": "text", "text": "Look:"}, IMAGE]},
                {"role": "user", "content": "What is it?"}]
    body = refused(lambda: client.chat.completions.create(model="m", messages=messages),
                   "messages[0].content[1].type", "invalid_value")
    assert "Supported values are: 'text'" in body["message"], body
    # relax-serve with a vision-language model takes image parts: not in a system or developer message
    service = _vl_service(smol, "a cat")
    with pytest.raises(APIError) as info:
        service.chat({"model": "vl", "messages": messages})
    assert info.value.param == "messages[0].content[1].type" and info.value.code == "invalid_value"
    # controls: the image in the user message is taken; the text alone in the system message is answered
    moved = [{"role": role, "content": [{"type": "text", "text": "Look:"}]},
             {"role": "user", "content": [IMAGE, {"type": "text", "text": "What is it?"}]}]
    status, answer = service.chat({"model": "vl", "messages": moved})
    assert status == 200 and answer["choices"][0]["message"]["content"] == "a cat"
    assert client.chat.completions.create(model="m", messages=moved[:1] + messages[1:]).choices


def test_a_history_tool_call_needs_its_id(client):
    for call, code in (({"type": "function"}, "missing_required_parameter"),
                       ({"id": None, "type": "function"}, "missing_required_parameter"),
                       ({"id": 7, "type": "function"}, "invalid_type")):
        body = refused(lambda c=call: client.chat.completions.create(model="m", messages=_history(c), tools=[TOOL]),
                       "messages[1].tool_calls[0].id", code)
        assert "'messages[1].tool_calls[0].id'" in body["message"], body
    refused(lambda: client.chat.completions.create(model="m", messages=_history({"type": "function"})[:2],
                                                   tools=[TOOL]), "messages[1].tool_calls[0].id")  # no tool answer
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    # LangChain sends a call built without an id with "id": null: OpenAI's 400, so Relax's
    llm = ChatOpenAI(model="m", base_url=client.gateway.base_url, api_key=client.api_key, max_retries=0)
    refused(lambda: llm.bind_tools([TOOL]).invoke(["x?", AIMessage("", tool_calls=[
        {"id": None, "name": "get_x", "args": {}}]), "go on"]), "messages[1].tool_calls[0].id")
    # controls: the ids the SDKs write (openai-agents' and LangChain's are in test_a_history_tool_call_needs_its_type)
    assert client.chat.completions.create(model="m", messages=_history({"id": "c1", "type": "function"}),
                                          tools=[TOOL]).choices[0].message.content == ANSWER


@pytest.mark.parametrize("role", ["assistant", "tool"])
def test_an_image_in_an_assistant_or_tool_message_is_refused(client, smol, role):
    from relax.serve.openai.protocol import APIError

    messages = _history({"id": "c1", "type": "function"}) + [{"role": "user", "content": "And now?"}]
    at = 1 if role == "assistant" else 2
    messages[at] = {**messages[at], "content": [{"type": "text", "text": "Here:"}, IMAGE]}
    body = refused(lambda: client.chat.completions.create(model="m", messages=messages, tools=[TOOL]),
                   f"messages[{at}].content[1].type", "invalid_value")
    assert "Invalid value: 'image_url'. Supported values are: 'text' (" in body["message"], body
    assert body["message"].endswith("; send images in a user message)."), body
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    refused(lambda: client.chat.completions.create(model="m", tools=[TOOL], messages=messages[:at] + [
        {**messages[at], "content": [audio]}] + messages[at + 1:]), f"messages[{at}].content[0].type", "invalid_value")
    # relax-serve with a vision-language model takes image parts, and would render this one: refused there too
    service = _vl_service(smol, "a cat")
    with pytest.raises(APIError) as info:
        service.chat({"model": "vl", "messages": messages, "tools": [TOOL]})
    assert info.value.param == f"messages[{at}].content[1].type" and info.value.code == "invalid_value"
    # controls: the image in a user message is taken; the text alone in the assistant or tool message is answered
    moved = messages[:at] + [{**messages[at], "content": messages[at]["content"][:1]}] + messages[at + 1:]
    moved[-1] = {"role": "user", "content": [IMAGE, {"type": "text", "text": "And now?"}]}
    status, answer = service.chat({"model": "vl", "messages": moved, "tools": [TOOL]})
    assert status == 200 and answer["choices"][0]["message"]["content"] == "a cat"
    assert client.chat.completions.create(model="m", messages=moved[:-1] + messages[-1:], tools=[TOOL]).choices
    # openai-agents' converter sends a tool output's text parts only (its default), so an image output passes
    from agents.models.chatcmpl_converter import Converter

    converted = Converter.items_to_messages([
        {"role": "user", "content": "x?"},
        {"type": "function_call", "call_id": "c1", "name": "get_x", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "1"}, {"type": "input_image", "image_url": IMAGE["image_url"]["url"]}]}])
    assert converted[2]["content"] == [{"type": "text", "text": "1"}]
    assert client.chat.completions.create(model="m", messages=converted, tools=[TOOL]).choices


def _r_history(call: dict) -> list[dict]:
    return [{"role": "user", "content": "x?"}, call, {"type": "function_call_output", "call_id": "c1", "output": "1"}]


def test_whitespace_arguments_are_refused_as_text_that_is_not_json(client):
    for blank in ("   ", "\n", "\t "):
        refused(lambda b=blank: client.chat.completions.create(
            model="m", messages=_history({"id": "c1", "type": "function"}, b), tools=[TOOL]),
            "messages[1].tool_calls[0].function.arguments")
        refused(lambda b=blank: client.responses.create(model="m", input=_r_history(
            {"type": "function_call", "call_id": "c1", "name": "get_x", "arguments": b}), tools=[R_TOOL]),
            "input[1].arguments")
    # controls: the empty string (OpenAI's own answers' no arguments) and JSON with JSON's whitespace around it
    for args in ("", " {} ", "{}\n"):
        assert client.chat.completions.create(model="m", messages=_history({"id": "c1", "type": "function"}, args),
                                              tools=[TOOL]).choices
        assert client.responses.create(model="m", input=_r_history(
            {"type": "function_call", "call_id": "c1", "name": "get_x", "arguments": args}), tools=[R_TOOL]).output


def test_a_function_call_item_names_its_missing_field(client):
    call = {"type": "function_call", "call_id": "c1", "name": "get_x", "arguments": "{}"}
    for key in ("name", "call_id"):
        missing = {k: v for k, v in call.items() if k != key}
        body = refused(lambda m=missing: client.responses.create(model="m", input=_r_history(m), tools=[R_TOOL]),
                       f"input[1].{key}", "missing_required_parameter")
        assert f"'input[1].{key}'" in body["message"], body
        refused(lambda k=key: client.responses.create(model="m", input=_r_history({**call, k: 5}), tools=[R_TOOL]),
                f"input[1].{key}", "invalid_type")
    refused(lambda: client.responses.create(model="m", input=[
        {"role": "user", "content": "x?"}, {"type": "function_call_output", "output": "1"}]),
        "input[1].call_id", "missing_required_parameter")
    assert client.responses.create(model="m", input=_r_history(call), tools=[R_TOOL]).output_text == ANSWER


def _formats(name):
    return ({"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMA}}},
            {"text": {"format": {"type": "json_schema", "name": name, "schema": SCHEMA}}})


def test_a_json_schema_name_is_held_to_openais_pattern(client):
    for name, code in (("my answer", "invalid_value"), ("answer.v1", "invalid_value"), ("Answer[int]", "invalid_value"),
                       ("a" * 65, "string_above_max_length")):
        chat, responses = _formats(name)
        refused(lambda c=chat: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                              **c), "response_format.json_schema.name", code)
        refused(lambda r=responses: client.responses.create(model="m", input="x", **r), "text.format.name", code)
    # controls: OpenAI's pattern at its limits, and what the SDKs name their formats by default
    for name in ("a" * 64, "final_output", "Answer-2_b"):
        chat, responses = _formats(name)
        assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], **chat).choices
        assert client.responses.create(model="m", input="x", **responses).output_text == ANSWER


def test_the_names_the_sdks_give_their_formats_pass(client):
    assert client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "x"}],
                                         response_format=Answer).choices[0].message.parsed == Answer(x=1)
    from agents import AgentOutputSchema
    from agents.models.chatcmpl_converter import Converter

    fmt = Converter.convert_response_format(AgentOutputSchema(Answer))
    assert fmt["json_schema"]["name"] == "final_output"
    assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                          response_format=fmt).choices
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="m", base_url=client.gateway.base_url, api_key=client.api_key, max_retries=0)
    assert llm.with_structured_output(Answer, method="json_schema").invoke("x") == Answer(x=1)
    assert llm.with_structured_output({"title": "answer_v1", **SCHEMA}, method="json_schema").invoke("x") == {"x": 1}


def test_prompt_cache_options_is_an_object_of_openais_keys(client):
    user = [{"role": "user", "content": "x"}]
    for value, param, code in (("30m", "prompt_cache_options", "invalid_type"),
                               (["30m"], "prompt_cache_options", "invalid_type"),
                               ({"ttl": "30m", "size": 1}, "prompt_cache_options.size", None),
                               ({"mode": "always"}, "prompt_cache_options.mode", "invalid_value"),
                               ({"ttl": 30}, "prompt_cache_options.ttl", "invalid_type")):
        refused(lambda v=value: client.chat.completions.create(model="m", messages=user,
                                                               extra_body={"prompt_cache_options": v}), param, code)
        refused(lambda v=value: client.responses.create(model="m", input="x", extra_body={"prompt_cache_options": v}),
                param, code)
    # Responses' prewarm prepares the cache and generates nothing: not what this server does
    refused(lambda: client.responses.create(model="m", input="x", prompt_cache_options={"prewarm": True}),
            "prompt_cache_options.prewarm")
    refused(lambda: client.chat.completions.create(model="m", messages=user,
                                                   extra_body={"prompt_cache_options": {"prewarm": False}}),
            "prompt_cache_options.prewarm")  # a Responses key, not Chat Completions'
    # controls: the reference's objects, through the SDK's own parameter
    options = {"mode": "explicit", "ttl": "30m"}
    assert client.chat.completions.create(model="m", messages=user, prompt_cache_options=options).choices
    assert client.responses.create(model="m", input="x", prompt_cache_options={
        **options, "prewarm": False, "comparison_response_id": "resp_1"}).output_text == ANSWER
    assert client.chat.completions.create(model="m", messages=user, extra_body={"prompt_cache_options": None}).choices
    assert json.loads(client.chat.completions.create(model="m", messages=user, prompt_cache_options={})
                      .choices[0].message.content) == {"x": 1}


def test_a_part_that_is_not_text_is_told_what_relax_takes_and_images_where_to_go():
    """Review-code2 finding 6b: the 400 for a part other than text in an assistant or tool message offers only what
    Relax takes ('text'): an assistant's refusal part, which OpenAI's schema takes, is refused too (Relax renders no
    refusal), so it is not offered; the advice to send images in a user message is given for image parts only.
    Negative control: before, an image in an assistant message was told "Supported values are: 'text' and
    'refusal'", a refusal part was then refused by another check ("only text parts ... are supported", param
    messages[i].content[j]), and an input_text part in a tool message was told to send images in a user message."""
    from relax.serve.openai.protocol import APIError, parse_chat

    def refusal(message: dict) -> APIError:
        with pytest.raises(APIError) as info:
            parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}, message,
                                                   {"role": "user", "content": "x"}]})
        return info.value

    for part, role, advice in (({"type": "refusal", "refusal": "no"}, "assistant", ""),
                               (IMAGE, "assistant", "; send images in a user message"),
                               ({"type": "input_text", "text": "r"}, "system", "")):
        err = refusal({"role": role, "content": [part]})
        assert (err.param, err.code) == ("messages[1].content[0].type", "invalid_value"), (part, err)
        article = "an" if role == "assistant" else "a"
        assert str(err) == (f"Invalid value: {part['type']!r}. Supported values are: 'text' (messages[1].content[0]"
                            f".type: {article} {role} message takes text parts only{advice})."), err
    # control: the same messages' text parts are taken
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "a"}]}, {"role": "user", "content": "x"}]})[0][1]["content"] == "a"
