"""Keys inside a request's objects (messages, content parts, tool calls, tools, response formats, stream options,
Responses input items) are checked as the top-level fields are: a key the OpenAI API does not define there is a 400
naming its path, every key it defines is accepted (those clients echo back from earlier answers with null or empty
values included), and a defined key set to a value Relax cannot honour is a 400 naming it. The lists of defined keys
are read from the installed openai package's request types, not from Relax; the echo-back tests send the official
client's own answer objects back. Also: the Responses API's top_logprobs error names `include`, and its
stream_options, like the chat route's, needs stream=true."""

from __future__ import annotations

import typing

import pytest
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionContentPartTextParam,
    ChatCompletionDeveloperMessageParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionStreamOptionsParam,
    ChatCompletionSystemMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionUserMessageParam,
)
from openai.types.responses import (
    EasyInputMessageParam,
    FunctionToolParam,
    ResponseFormatTextJSONSchemaConfigParam,
    ResponseFunctionToolCallParam,
    ResponseInputTextParam,
    ResponseOutputMessageParam,
    ResponseOutputTextParam,
    ResponseReasoningItemParam,
)
from openai.types.responses.response_create_params import StreamOptions
from openai.types.responses.response_input_item_param import FunctionCallOutput
from openai.types.shared_params import FunctionDefinition
from openai.types.shared_params.response_format_json_schema import JSONSchema

from relax.serve.openai.protocol import APIError, parse_chat
from relax.serve.openai.responses import LOGPROBS_INCLUDE, parse_request
from tests.openai.scripted import ScriptedGateways


def keys(typed: type) -> set[str]:
    """Every key an openai request TypedDict defines (inherited and reserved-word ones included)."""
    return set(typing.get_type_hints(typed))


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def chat(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def refused(parse, body: dict, param: str) -> str:
    """The message of the 400 `parse(body)` raises, which must name `param`."""
    with pytest.raises(APIError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.param == param, (info.value.param, str(info.value))
    assert param in str(info.value)
    return str(info.value)


def with_every_key(typed: type, base: dict, skip: tuple[str, ...] = ()) -> dict:
    """`base` with each other key `typed` defines set to null."""
    return {**{k: None for k in keys(typed) if k not in skip}, **base}


# ------------------------------------------------------------------------------------------------ chat
CHAT_CASES = [  # (the type, a body holding an object of it built by `make(obj)`, a valid minimal object, its path)
    (ChatCompletionSystemMessageParam, {"role": "system", "content": "s"}, "messages[0]"),
    (ChatCompletionDeveloperMessageParam, {"role": "developer", "content": "s"}, "messages[0]"),
    (ChatCompletionUserMessageParam, {"role": "user", "content": "hi"}, "messages[0]"),
    (ChatCompletionAssistantMessageParam, {"role": "assistant", "content": "a"}, "messages[1]"),
    (ChatCompletionToolMessageParam, {"role": "tool", "content": "r", "tool_call_id": "c1"}, "messages[2]"),
    (ChatCompletionContentPartTextParam, {"type": "text", "text": "hi"}, "messages[0].content[0]"),
    (ChatCompletionMessageFunctionToolCallParam, dict(CALL), "messages[1].tool_calls[0]"),
    (ChatCompletionFunctionToolParam, dict(TOOL), "tools[0]"),
    (FunctionDefinition, dict(TOOL["function"]), "tools[0].function"),
    (JSONSchema, {"name": "A", "schema": {"type": "object"}}, "response_format.json_schema"),
    (ChatCompletionStreamOptionsParam, {"include_usage": True}, "stream_options"),
    (ChatCompletionNamedToolChoiceParam, {"type": "function", "function": {"name": "f"}}, "tool_choice"),
]


def chat_body(path: str, obj: dict) -> dict:
    """A chat request with `obj` at `path`."""
    user: dict = {"role": "user", "content": "hi"}
    assistant: dict = {"role": "assistant", "content": None, "tool_calls": [dict(CALL)]}
    tool: dict = {"role": "tool", "content": "r", "tool_call_id": "c1"}
    body = chat(messages=[user, assistant, tool])
    if path == "messages[0]":
        body["messages"] = [obj]
    elif path == "messages[1]":
        body["messages"] = [user, obj]
    elif path == "messages[2]":
        body["messages"][2] = obj
    elif path == "messages[0].content[0]":
        user["content"] = [obj]
    elif path == "messages[1].tool_calls[0]":
        assistant["tool_calls"] = [obj]
    elif path == "tools[0]":
        body["tools"] = [obj]
    elif path == "tools[0].function":
        body["tools"] = [{"type": "function", "function": obj}]
    elif path == "response_format.json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": obj}
    elif path == "stream_options":
        body.update(stream=True, stream_options=obj)
    elif path == "tool_choice":
        body.update(tools=[TOOL], tool_choice=obj)
    return body


@pytest.mark.parametrize("typed, obj, path", CHAT_CASES, ids=[c[2] for c in CHAT_CASES])
def test_chat_takes_every_key_openai_defines_and_refuses_others_by_path(typed, obj, path):
    """Each object with every key its openai type defines (the others null) parses; with a key no type defines
    (`cache_control`, as Anthropic clients send) it is a 400 naming the key's path. The control: the minimal object
    parses, so the 400 is the key's."""
    parse_chat(chat_body(path, obj))
    parse_chat(chat_body(path, with_every_key(typed, obj)))
    refused(parse_chat, chat_body(path, {**obj, "cache_control": {"type": "ephemeral"}}), f"{path}.cache_control")


def test_chat_response_format_objects_and_nested_function_keys_are_checked():
    refused(parse_chat, chat(response_format={"type": "json_object", "schema": {}}), "response_format.schema")
    refused(parse_chat, chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f", "x": 1}}),
            "tool_choice.function.x")
    body = chat_body("messages[1].tool_calls[0]", {**CALL, "function": {**CALL["function"], "index": 0}})
    refused(parse_chat, body, "messages[1].tool_calls[0].function.index")


@pytest.mark.parametrize("key, value", [("refusal", "I can't."), ("audio", {"id": "audio_1"}),
                                        ("function_call", {"name": "f", "arguments": "{}"}),
                                        ("annotations", [{"type": "url_citation", "url_citation": {
                                            "url": "https://x", "title": "x", "start_index": 0, "end_index": 1}}])])
def test_an_echoed_back_assistant_field_relax_cannot_render_is_a_400_unless_empty(key, value):
    """An assistant message's refusal, audio, legacy function_call and annotations: null or empty (as a client
    echoes an answer of this server back) is accepted, a value is a 400 naming it (it would otherwise be dropped
    from the prompt unseen)."""
    for empty in (None, "", [], {}):
        if key == "refusal" and empty not in (None, ""):
            continue
        parse_chat(chat_body("messages[1]", {"role": "assistant", "content": "a", key: empty}))
    refused(parse_chat, chat_body("messages[1]", {"role": "assistant", "content": "a", key: value}),
            f"messages[1].{key}")


def test_a_tool_call_of_another_type_is_a_400_naming_its_type():
    refused(parse_chat, chat_body("messages[1].tool_calls[0]", {**CALL, "type": "custom"}),
            "messages[1].tool_calls[0].type")


# ------------------------------------------------------------------------------------------------ responses
def responses(**kw) -> dict:
    return {"model": "m", "input": "hi", **kw}


def no_previous(rid: str) -> list[dict]:
    raise AssertionError(rid)


def parse_responses(body: dict):
    return parse_request(body, no_previous)


FN_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": False}
RESPONSES_CASES = [  # (the type, a minimal valid object, its path, how a request holds it)
    (EasyInputMessageParam, {"role": "user", "content": "hi"}, "input[0]", lambda o: {"input": [o]}),
    (ResponseOutputMessageParam, {"type": "message", "id": "m1", "role": "assistant", "status": "completed",
                                  "content": [{"type": "output_text", "text": "a", "annotations": []}]},
     "input[1]", lambda o: {"input": [{"role": "user", "content": "hi"}, o]}),
    (ResponseInputTextParam, {"type": "input_text", "text": "hi"}, "input[0].content[0]",
     lambda o: {"input": [{"role": "user", "content": [o]}]}),
    (ResponseOutputTextParam, {"type": "output_text", "text": "a", "annotations": []}, "input[1].content[0]",
     lambda o: {"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [o]}]}),
    (ResponseFunctionToolCallParam, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
     "input[1]", lambda o: {"input": [{"role": "user", "content": "hi"}, o], "tools": [FN_TOOL]}),
    (FunctionCallOutput, {"type": "function_call_output", "call_id": "c1", "output": "r"}, "input[2]",
     lambda o: {"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1",
                                                              "name": "f", "arguments": "{}"}, o],
                "tools": [FN_TOOL]}),
    (ResponseReasoningItemParam, {"type": "reasoning", "id": "r1", "summary": []}, "input[1]",
     lambda o: {"input": [{"role": "user", "content": "hi"}, o, {"role": "assistant", "content": "a"}]}),
    (FunctionToolParam, dict(FN_TOOL), "tools[0]", lambda o: {"tools": [o]}),
    (ResponseFormatTextJSONSchemaConfigParam, {"type": "json_schema", "name": "A", "schema": {"type": "object"}},
     "text.format", lambda o: {"text": {"format": o}}),
    (StreamOptions, {"include_obfuscation": True}, "stream_options", lambda o: {"stream": True, "stream_options": o}),
]


@pytest.mark.parametrize("typed, obj, path, hold", RESPONSES_CASES, ids=[f"{c[0].__name__}" for c in RESPONSES_CASES])
def test_responses_take_every_key_openai_defines_and_refuse_others_by_path(typed, obj, path, hold):
    parse_responses(responses(**hold(obj)))
    parse_responses(responses(**hold(with_every_key(typed, obj))))
    refused(parse_responses, responses(**hold({**obj, "cache_control": {"type": "ephemeral"}})),
            f"{path}.cache_control")


@pytest.mark.parametrize("path, obj, hold", [
    ("input[0].phase", {"role": "assistant", "content": "a", "phase": "final_answer"}, lambda o: {"input": [o]}),
    ("input[0].encrypted_content", {"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "gAAA"},
     lambda o: {"input": [o, {"role": "user", "content": "hi"}]}),
    ("input[0].content[0].annotations", {"role": "assistant", "content": [
        {"type": "output_text", "text": "a", "annotations": [{"type": "file_path", "file_id": "f", "index": 0}]}]},
     lambda o: {"input": [o]}),
    ("tools[0].defer_loading", {**FN_TOOL, "defer_loading": True}, lambda o: {"tools": [o]}),
    ("tools[0].allowed_callers", {**FN_TOOL, "allowed_callers": ["programmatic"]}, lambda o: {"tools": [o]}),
    ("input[1].caller", {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
                         "caller": {"type": "program", "caller_id": "p"}},
     lambda o: {"input": [{"role": "user", "content": "hi"}, o], "tools": [FN_TOOL]}),
])
def test_a_responses_key_set_to_what_relax_cannot_honour_is_a_400_naming_it(path, obj, hold):
    refused(parse_responses, responses(**hold(obj)), path)


def test_responses_top_logprobs_without_include_names_include_not_a_chat_field():
    """top_logprobs alone: the 400 tells a Responses user what to set (include), not the chat route's logprobs,
    which the Responses API does not have; with include it is taken."""
    message = refused(parse_responses, responses(top_logprobs=2), "top_logprobs")
    assert LOGPROBS_INCLUDE in message and "include" in message and "logprobs=true" not in message
    req = parse_responses(responses(top_logprobs=2, include=[LOGPROBS_INCLUDE]))
    assert req.chat["top_logprobs"] == 2 and req.chat["logprobs"] is True


def test_stream_options_needs_stream_on_both_routes():
    """The Responses API's stream_options ("only set this when you set stream: true") is refused without stream,
    as the chat route refuses its own."""
    refused(parse_chat, chat(stream_options={"include_usage": True}), "stream_options")
    refused(parse_responses, responses(stream_options={"include_obfuscation": False}), "stream_options")
    refused(parse_responses, responses(stream=False, stream_options={"include_obfuscation": False}), "stream_options")
    parse_responses(responses(stream=True, stream_options={"include_obfuscation": False}))
    refused(parse_responses, responses(stream=True, stream_options={"include_usage": True}),
            "stream_options.include_usage")


# ------------------------------------------------------------------------------------------------ echo-backs
@pytest.fixture
def gateway(smol):
    gateways = ScriptedGateways()
    yield lambda texts: gateways.make(smol, texts)
    gateways.close()


def test_the_official_clients_answers_sent_back_as_they_come_are_accepted(gateway):
    """The chat answer's message (model_dump: refusal, annotations, audio, function_call as null) and the Responses
    answer's output items (every field of their types, null ones included) go back as the next call's input."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    _, script, _, client = gateway([call, "done", call, "done"])
    tools = [TOOL]
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=30)
    echoed = r.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(echoed)
    messages += [echoed, {"role": "tool", "tool_call_id": echoed["tool_calls"][0]["id"], "content": "ok"}]
    assert client.chat.completions.create(model="policy", messages=messages, tools=tools,
                                          max_tokens=30).choices[0].message.content == "done"
    fn = [{"type": "function", "name": "f", "parameters": TOOL["function"]["parameters"], "strict": False}]
    r = client.responses.create(model="policy", input="hi", tools=fn, max_output_tokens=30)
    items = [o.model_dump() for o in r.output]
    assert items[0]["type"] == "function_call"
    follow = [{"role": "user", "content": "hi"}, *items,
              {"type": "function_call_output", "call_id": items[0]["call_id"], "output": "ok"}]
    r = client.responses.create(model="policy", input=follow, tools=fn, max_output_tokens=30)
    assert r.output_text == "done"
    again = [*follow, *[o.model_dump() for o in r.output], {"role": "user", "content": "thanks"}]
    assert client.responses.create(model="policy", input=again, tools=fn, max_output_tokens=30).output_text
    assert len(script.calls) == 5


def test_image_parts_are_checked_before_they_become_placeholders(smol):
    """relax-serve with a vision-language model turns image parts into placeholders (dropping the rest of the part):
    their keys are checked first, against openai's ChatCompletionContentPartImageParam and its ImageURL; a detail
    other than "auto" is a 400 (the image is read at the processor's resolution)."""
    from openai.types.chat.chat_completion_content_part_image_param import (
        ChatCompletionContentPartImageParam,
        ImageURL,
    )

    from relax.serve.openai.service import OpenAIService
    from tests.openai.scripted import Script

    service = OpenAIService(smol, Script(smol, ["a cat"]), model="vl", context_length=None, max_tokens=8,
                            images=True)

    def body(part: dict) -> dict:
        return chat(messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}])

    url = {"url": "data:image/png;base64,AAAA"}
    part = {"type": "image_url", "image_url": url}
    full = with_every_key(ChatCompletionContentPartImageParam, {**part, "image_url": with_every_key(ImageURL, url)})
    for ok in (part, full, {**part, "image_url": {**url, "detail": "auto"}}):
        status, answer = service.chat(body(ok))
        assert status == 200 and answer["choices"][0]["message"]["content"] == "a cat"
    refused(lambda b: service.chat(b), body({**part, "cache_control": {}}), "messages[0].content[0].cache_control")
    refused(lambda b: service.chat(b), body({**part, "image_url": {**url, "size": 1}}),
            "messages[0].content[0].image_url.size")
    refused(lambda b: service.chat(b), body({**part, "image_url": {**url, "detail": "low"}}),
            "messages[0].content[0].image_url.detail")
