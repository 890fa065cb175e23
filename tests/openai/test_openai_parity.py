"""Where the served OpenAI API answers as OpenAI does, driven by the official `openai` client (plain HTTP where the
client hides the wire) against the training gateway and relax-serve: reasoning tokens in the usage, tool-call
arguments as the model wrote them, the first streamed delta's content, tool messages that answer no call, wrong HTTP
methods (405 with Allow) and the model object (`GET /v1/models/{id}`, `created`).

Scripted engines (fixed tokens) answer behind the gateway, so the counts are exact; the relax-serve test starts the
embedded server with the tiny model (slow)."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from relax.data.tokenizer import build_tiny_tokenizer
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway

USER = [{"role": "user", "content": "What is 3 + 4?"}]
QWEN3_LIKE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% endif %}")
THINKING = "<think>\nwhat is 3 + 4 = 7\n</think>\n\n7"
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = 'Let me look. <tool_call>{"name": "weather", "arguments": {"city": "Zürich"}}</tool_call>'


@pytest.fixture(scope="module")
def thinking_format() -> ChatFormat:
    """The tiny tokenizer with Qwen3's <think> tags as added tokens and a template that uses them."""
    tok = build_tiny_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_LIKE + "{# <think> #}"
    return ChatFormat(tok, (tok.eos_token_id,))


@pytest.fixture
def gateway(scripted_gateway):
    return scripted_gateway


def think_tokens(fmt: ChatFormat, ids: list[int]) -> int:
    """The sampled tokens of the <think> block, by token id: up to and including the </think> token."""
    return ids.index(fmt.tokenizer.convert_tokens_to_ids("</think>")) + 1


# ------------------------------------------------------------------------------------------- reasoning tokens

def test_reasoning_tokens_are_the_think_blocks_sampled_tokens_on_chat_and_responses(gateway, thinking_format):
    fmt = thinking_format
    gw, script, session, client = gateway(fmt, [THINKING])
    r = client.chat.completions.create(model="m", messages=USER, n=2)
    ids = script.ids(-1)
    expected = think_tokens(fmt, ids)
    assert 1 < expected < len(ids) - 1  # the block, not the answer "7" nor the stop token
    assert r.choices[0].message.reasoning_content == "what is 3 + 4 = 7"
    assert r.usage.completion_tokens == 2 * len(ids)  # counted within completion_tokens, summed over choices
    assert r.usage.completion_tokens_details.reasoning_tokens == 2 * expected
    chunks = list(client.chat.completions.create(model="m", messages=USER, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == expected
    resp = client.responses.create(model="m", input="What is 3 + 4?")
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.usage.output_tokens == len(ids) and resp.usage.output_tokens_details.reasoning_tokens == expected
    events = list(client.responses.create(model="m", input="What is 3 + 4?", stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == expected


def test_a_block_cut_unclosed_is_all_reasoning(gateway, thinking_format):
    """An unclosed block is all reasoning (as split_reasoning reads it): every token but the stop token."""
    gw, script, session, client = gateway(thinking_format, ["<think>\nwhat is 3 + 4"])
    r = client.chat.completions.create(model="m", messages=USER)
    assert r.choices[0].message.reasoning_content == "what is 3 + 4"
    assert r.usage.completion_tokens_details.reasoning_tokens == len(script.ids(-1)) - 1


def test_no_reasoning_reports_none_on_chat_and_zero_on_responses(gateway, thinking_format):
    """Negative controls: an answer without a block, and one whose block stays in the content."""
    gw, script, session, client = gateway(thinking_format, ["7"])
    r = client.chat.completions.create(model="m", messages=USER)
    assert r.usage.completion_tokens_details is None and r.choices[0].message.content == "7"
    assert client.responses.create(model="m", input="hi").usage.output_tokens_details.reasoning_tokens == 0
    gw, script, session, client = gateway(thinking_format, [THINKING])
    whole = client.chat.completions.create(model="m", messages=USER, extra_body={"separate_reasoning": False})
    assert whole.choices[0].message.content == THINKING and whole.usage.completion_tokens_details is None


# ------------------------------------------------------------------------------ tool calls: arguments, stream

def test_tool_call_arguments_are_written_as_the_model_wrote_them_and_the_session_continues(gateway, smol):
    gw, script, session, client = gateway(smol, [CALL])
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    call = r.choices[0].message.tool_calls[0]
    assert call.function.arguments == '{"city": "Zürich"}'  # not {"city": "Z\u00fcrich"}
    gw, script, session, client = gateway(smol, [CALL])
    resp = client.responses.create(model="m", input="Weather in Zürich?", tools=[
        {"type": "function", "name": "weather", "parameters": WEATHER["function"]["parameters"]}])
    assert resp.output[-1].type == "function_call" and resp.output[-1].arguments == '{"city": "Zürich"}'
    # the next turn continues the sampled tokens: one segment, nothing re-rendered
    gw, script, session, client = gateway(smol, [CALL, "It is sunny in Zürich."])
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    call = r.choices[0].message.tool_calls[0]
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny in Zürich."
    t = session.trajectory()
    (first, _), (second, _) = script.calls
    first_ids = script.ids(0)
    assert session.segments == 1 and second["input_ids"][:len(first["input_ids"]) + len(first_ids)] == \
        first["input_ids"] + first_ids == (t.prompt + t.tokens)[:len(first["input_ids"]) + len(first_ids)]


def _first_delta(gw: Gateway, key: str, body: dict) -> dict:
    raw = requests.post(gw.base_url + "/chat/completions", json={**body, "stream": True}, timeout=30,
                        headers={"Authorization": f"Bearer {key}"}).text
    first = json.loads(raw.split("\n\n")[0][len("data: "):])
    return first["choices"][0]["delta"]


def test_the_first_streamed_delta_has_null_content_for_calls_only_and_empty_for_text(gateway, smol):
    gw, script, session, client = gateway(smol, ['<tool_call>{"name": "weather", "arguments": {"city": "Bern"}}'
                                                 "</tool_call>"])
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    assert _first_delta(gw, session.key, body) == {"role": "assistant", "content": None}
    with client.chat.completions.stream(**body) as stream:
        message = stream.get_final_completion().choices[0].message
    assert message.content is None and message.tool_calls[0].function.arguments == '{"city": "Bern"}'
    # a text answer (and text with a call) starts with "", as OpenAI streams it
    for text, content in (("Hello there.", "Hello there."), (CALL, "Let me look.")):
        gw, script, session, client = gateway(smol, [text])
        assert _first_delta(gw, session.key, body) == {"role": "assistant", "content": ""}
        with client.chat.completions.stream(**body) as stream:
            assert stream.get_final_completion().choices[0].message.content == content


# --------------------------------------------------------------------------------- tool messages without a call

@pytest.mark.parametrize("tool_message, why", [
    ({"role": "tool", "content": "sunny"}, "Missing required parameter"),
    ({"role": "tool", "tool_call_id": "call_nobody_made", "content": "sunny"}, "answers no tool call"),
])
def test_a_tool_message_must_answer_a_call_of_the_assistant_message_before_it(gateway, smol, tool_message, why):
    gw, script, session, client = gateway(smol, [CALL, "Sunny."])
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=messages + [tool_message], tools=[WEATHER])
    assert info.value.status_code == 400 and info.value.body["param"] == "messages[2].tool_call_id"
    assert why in info.value.body["message"]
    # a tool message after a user message answers no call either
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", tools=[WEATHER], messages=messages + [
            {"role": "user", "content": "well?"},
            {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "sunny"}])
    assert info.value.body["param"] == "messages[3].tool_call_id"
    # the control: the call's own id is accepted, also as the second of two tool messages
    ok = {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "sunny"}
    assert client.chat.completions.create(model="m", messages=messages + [ok], tools=[WEATHER]).choices
    assert client.chat.completions.create(model="m", messages=messages + [ok, ok], tools=[WEATHER]).choices


def test_a_function_call_output_answering_no_call_is_a_400_on_responses(gateway, smol):
    gw, script, session, client = gateway(smol, ["Sunny."])
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input=[{"role": "user", "content": "Weather?"},
                                                  {"type": "function_call_output", "call_id": "call_x", "output": "1"}])
    assert info.value.body["param"] == "input"


# ------------------------------------------------------------------------------------------ methods and models

@pytest.mark.parametrize("method, path, allow", [("GET", "/chat/completions", "POST"),
                                                 ("PUT", "/chat/completions", "POST"),
                                                 ("DELETE", "/responses", "POST"), ("PATCH", "/completions", "POST"),
                                                 ("POST", "/models", "GET"), ("DELETE", "/models/policy", "GET")])
def test_the_gateway_answers_a_wrong_method_with_405_and_allow(gateway, smol, method, path, allow):
    gw, script, session, client = gateway(smol, ["hi"])
    for headers in ({"Authorization": f"Bearer {session.key}"}, {}):  # before the key, as relax-serve
        r = requests.request(method, gw.base_url + path, headers=headers, timeout=30)
        assert r.status_code == 405 and r.headers["Allow"] == allow
        assert r.json()["error"]["code"] == "method_not_allowed" and r.json()["error"]["type"] == \
            "invalid_request_error"
    assert requests.get(gw.base_url + "/nothing", timeout=30).status_code == 404  # an unknown path stays a 404


def test_the_gateway_serves_the_model_object_by_id(gateway, smol):
    gw, script, session, client = gateway(smol, ["hi"])
    listed = client.models.list().data
    one = client.models.retrieve("policy")
    assert [m.id for m in listed] == ["policy"] and one == listed[0]
    assert (one.object, one.owned_by) == ("model", "relax") and isinstance(one.created, int) and one.created > 0
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    # ...while a chat request may name any model, as on SGLang (agent frameworks send the name their user
    # configured): the served model answers, and the answer echoes the request's name (docs/agents.md)
    r = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert (r.model, r.choices[0].message.content) == ("gpt-4o", "hi")
    bad_key = openai.OpenAI(base_url=gw.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.retrieve("policy")


@pytest.mark.slow
def test_relax_serve_model_objects_have_created(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    listed = client.models.list().data
    assert len(listed) == 1 and isinstance(listed[0].created, int) and listed[0].created > 0
    assert client.models.retrieve(listed[0].id) == listed[0] and listed[0].object == "model"
