"""A chat template that refuses a conversation (its own `raise_exception`) is the client's 400 naming the template's
message, on relax-serve and in the training gateway, on the chat and the Responses routes, through the official
`openai` client (which retries a 500 and raises `InternalServerError`); a template that refuses a system message gets
the tools prompt Relax writes at the start of the first user message instead (`ChatFormat.render`).

The expected messages are the template's own: `apply_chat_template` of the same conversation, called here. Negative
control: before this change every case below was a 500 whose message was the `TemplateError` with its class name
(and the system-role template a 500 on any call with tools).
"""

from __future__ import annotations

import copy
import json

import pytest
from jinja2 import TemplateError

from relax.serve.openai.chat import ChatFormat, tools_prompt
from relax.serve.openai.protocol import normalize_message
from tests.agents.templates import base_tokenizer, family_tokenizer

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris and Rome?"}]
TWO_CALLS = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{k}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
        for k, c in enumerate(["Paris", "Rome"])]},
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
# Gemma's: no system role at all, whatever the conversation
NO_SYSTEM = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
             "{{ raise_exception('System role not supported') }}{% endif %}"
             "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + m['content'] "
             "+ '<end_of_turn>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def _template_message(tok, messages: list[dict], **kw) -> str:
    """The message the template itself raises for `messages` (OpenAI's, arguments as mappings: transformers')."""
    own = copy.deepcopy(messages)
    for m in own:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    with pytest.raises(TemplateError) as info:
        tok.apply_chat_template(own, tokenize=False, add_generation_prompt=True, **kw)
    return str(info.value)


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    from tests.openai.serving import tiny_server

    with tiny_server(tmp_path_factory.mktemp("llama-tokenizer"), family_tokenizer("llama3_1")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value


def test_llama_parallel_calls_in_a_new_prompt_are_a_400_naming_the_template(llama_server, gateways):
    tok = family_tokenizer("llama3_1")
    expected = _template_message(tok, TWO_CALLS, tools=TOOLS)
    assert "single tool-calls" in expected
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    _, _, _, gateway = gateways.make(fmt, ["x"])
    responses_input = [USER[0]] + [{"type": "function_call", "call_id": f"call_{k}", "name": "get_weather",
                                    "arguments": json.dumps({"city": c})} for k, c in enumerate(["Paris", "Rome"])] + [
        {"type": "function_call_output", "call_id": f"call_{k}", "output": o} for k, o in enumerate(["sunny", "rain"])]
    for client in (llama_server, gateway):  # relax-serve, and the gateway's first call (a new prompt)
        exc = _refused(lambda c=client: c.chat.completions.create(model="policy", messages=TWO_CALLS, tools=TOOLS))
        assert exc.status_code == 400 and expected in exc.message and exc.body["param"] == "messages", exc.message
        exc = _refused(lambda c=client: c.responses.create(model="policy", input=responses_input, tools=[
            {"type": "function", **TOOLS[0]["function"]}]))
        assert exc.status_code == 400 and expected in exc.message, exc.message


def test_a_continuation_the_template_refuses_is_a_400(gateways):
    """A later call of a session (rendered after the sampled tokens): Mistral v0.1's alternating roles refuse a
    second user message in a row, as the template itself does."""
    tok = copy.deepcopy(base_tokenizer())
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    _, _, _, client = gateways.make(fmt, ["Hello."])
    answer = client.chat.completions.create(model="policy", messages=USER).choices[0].message
    more = USER + [{"role": "assistant", "content": answer.content}, {"role": "user", "content": "And?"},
                   {"role": "user", "content": "Well?"}]
    expected = _template_message(tok, more)
    exc = _refused(lambda: client.chat.completions.create(model="policy", messages=more))
    assert exc.status_code == 400 and expected in exc.message, exc.message


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_user_message(gateways):
    tok = copy.deepcopy(base_tokenizer())
    tok.chat_template = NO_SYSTEM
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    prompt = tools_prompt(TOOLS, "hermes")
    # what the template itself renders with the prompt written into the user's message by hand
    expected = tok.apply_chat_template([{"role": "user", "content": f"{prompt}\n\n{USER[0]['content']}"}],
                                       tokenize=False, add_generation_prompt=True)
    assert fmt.render([normalize_message(m) for m in USER], TOOLS) == expected
    _, script, _, client = gateways.make(fmt, ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                               '\n</tool_call>'])
    answer = client.chat.completions.create(model="policy", messages=USER, tools=TOOLS)
    assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert script.calls[0][0]["input_ids"] == fmt.encode(expected)
    # a system message of the client's own is the client's: the template's refusal, named
    own = [{"role": "system", "content": "Be brief."}] + USER
    exc = _refused(lambda: client.chat.completions.create(model="policy", messages=own, tools=TOOLS))
    assert exc.status_code == 400 and "System role not supported" in exc.message, exc.message


def test_mistral_call_ids_are_the_nine_characters_its_template_takes_back(gateways):
    """Relax does not cause Mistral v0.3's refusal: with the mistral parser a call's id is 9 letters and digits (as
    vLLM's mistral parser writes it), so the results sent back render; the template itself takes that history.
    Negative control: with `call_` + 24 hex digits the follow-up was the template's 400 ("Tool call IDs should be
    alphanumeric strings with length 9!")."""
    from tests.agents.test_tool_templates_beyond_fixtures import MISTRAL_SPECIAL, MISTRAL_V3, tokenizer_with

    tok = tokenizer_with(MISTRAL_V3, MISTRAL_SPECIAL)
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    _, _, _, client = gateways.make(fmt, ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                                          "Sunny in Paris."])
    message = client.chat.completions.create(model="policy", messages=USER[:1], tools=TOOLS).choices[0].message
    ids = [c.id for c in message.tool_calls]
    assert len(ids) == 1 and all(len(i) == 9 and i.isalnum() for i in ids), ids
    follow = USER[:1] + [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": ids[0], "content": "sunny"}]
    own = copy.deepcopy(follow)
    for c in own[1]["tool_calls"]:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    tok.apply_chat_template(own, tools=TOOLS, tokenize=False)  # the template takes it (raises otherwise)
    answer = client.chat.completions.create(model="policy", messages=follow, tools=TOOLS).choices[0].message
    assert answer.content == "Sunny in Paris."
