"""The OpenAI request and answer shapes (relax.serve.openai.protocol) and the chat format (chat.py): what is
refused and how, messages compared by meaning, tool calls read from a model's text, stop sequences cut, and the
rendering of a continuation against the chat template's own rendering of the whole conversation."""

from __future__ import annotations

import json

import pytest

from relax.data.tokenizer import build_tiny_tokenizer
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.protocol import APIError, normalize_message, parse_chat, parse_completion, same_message

USER = [{"role": "user", "content": "What is 3 + 4?"}]
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


def chat(**kw) -> dict:
    return {"model": "m", "messages": USER, **kw}


@pytest.mark.parametrize("body, param", [
    (chat(frequency_penalty=0.5), "frequency_penalty"),
    (chat(logit_bias={"1": 5}), "logit_bias"),
    (chat(response_format={"type": "xml"}), "response_format"),
    (chat(tool_choice="required"), "tool_choice"),  # forced calls need tools
    (chat(tool_choice={"type": "function", "function": {"name": "other"}}, tools=[TOOL]), "tool_choice"),
    (chat(regex="a+", json_schema="{}"), "response_format"),  # one grammar at most
    (chat(tools=[{"type": "function"}]), "tools[0]"),
    (chat(n=0), "n"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(temperature=2.5), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat(top_logprobs=3), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(wat=1), "wat"),
    ({"messages": USER}, "model"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
])
def test_a_bad_chat_request_is_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as info:
        parse_chat(body)
    err = info.value
    assert err.status == 400 and err.param == param
    assert err.body() == {"error": {"message": str(err), "type": "invalid_request_error", "param": param,
                                    "code": None}}


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": ""}, "prompt"), ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"), ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"), ({"model": "m", "prompt": "x", "tools": []}, "tools"),
])
def test_a_bad_completion_request_is_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as info:
        parse_completion(body)
    assert info.value.status == 400 and info.value.param == param


def test_a_good_request_reads_into_its_parameters():
    messages, p = parse_chat(chat(n=3, max_tokens=9, max_completion_tokens=7, temperature=0.5, top_p=0.9,
                                  stop="\n", seed=4, logprobs=True, top_logprobs=2, tools=[TOOL], user="u"))
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.stop, p.seed, p.top_logprobs) == (3, 7, 0.5, 0.9, ["\n"], 4,
                                                                                          2)
    assert p.tools == [TOOL] and messages == [{"role": "user", "content": "What is 3 + 4?"}]
    assert parse_chat(chat(tools=[TOOL], tool_choice="none"))[1].tools is None  # "none": the model sees no tools


def test_messages_compare_by_meaning():
    """Text parts join; tool calls compare by name and parsed arguments, not by id or JSON spacing."""
    a = normalize_message({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1, "y": 2}'}}]})
    b = normalize_message({"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "calc", "arguments": '{"y":2,"x":1}'}}]})
    c = normalize_message({"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "calc", "arguments": '{"y":3,"x":1}'}}]})
    assert same_message(a, b) and not same_message(a, c)
    parts = normalize_message({"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text",
                                                                                           "text": "c"}]})
    assert same_message(parts, {"role": "user", "content": "ab\nc"})  # parts joined by newlines, as vLLM joins them
    assert not same_message(parts, {"role": "user", "content": "ab\nd"})


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    tok = build_tiny_tokenizer()
    return ChatFormat(tok, (tok.eos_token_id,))


def test_tool_calls_are_read_from_the_models_text():
    content, calls = ChatFormat.tool_calls('Let me compute. <tool_call>{"name": "calculator", "arguments": '
                                           '{"expression": "37 * 48"}}</tool_call>')
    assert content == "Let me compute."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "calculator", {"expression": "37 * 48"})]
    assert calls[0]["id"].startswith("call_")
    listed = ChatFormat.tool_calls('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
                                   '"{\\"k\\": 1}"}]</tool_call>')[1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in listed] == [("a", {}),
                                                                                                ("b", {"k": 1})]
    for broken in ("<tool_call>{not json}</tool_call>", '<tool_call>{"name": "a"}', "no call at all"):
        assert ChatFormat.tool_calls(broken) == (broken, None)  # left as text, never half-parsed


def test_a_stop_sequence_cuts_the_text_before_it_and_the_tokens_after_it(fmt):
    tokens = fmt.encode("3 + 4 is 7\nwhat") + [fmt.tokenizer.eos_token_id]
    kept, text, end, cut = fmt.answer_text(tokens, ["\n"])
    assert (text, end, cut) == ("3 + 4 is 7", None, True)
    assert fmt.decode(kept) == "3 + 4 is 7\n"  # the model sampled the stop sequence: it stays in the tokens
    kept, text, end, cut = fmt.answer_text(tokens, [])
    assert (kept, text, end, cut) == (tokens, "3 + 4 is 7\nwhat", fmt.tokenizer.eos_token_id, False)


def test_a_continuation_is_the_chat_templates_rendering_of_the_new_messages(fmt):
    """Appended after an answer that ended with the stop token, the continuation's tokens make the template's own
    rendering of the whole conversation (here the tiny tokenizer re-tokenizes the answer as sampled)."""
    answer = "7"
    first = fmt.prompt(USER, None)
    sampled = fmt.encode(answer) + [fmt.tokenizer.eos_token_id]
    new = [{"role": "user", "content": "what is the final answer"}]
    continued = first + sampled + fmt.continuation(new, fmt.tokenizer.eos_token_id)
    whole = USER + [{"role": "assistant", "content": answer}] + new
    assert continued == fmt.prompt(whole, None)
    # after an answer cut at its length (no stop token), the continuation first closes the assistant message
    assert first + fmt.encode(answer) + fmt.continuation(new, None) == fmt.prompt(whole, None)


def test_tools_go_into_a_system_message_when_the_template_has_no_place_for_them(fmt):
    plain, with_tools = fmt.render(USER, None), fmt.render(USER, [TOOL])
    assert with_tools.startswith("<|im_start|>system\n") and '"name": "calculator"' in with_tools
    assert "<tool_call>" in with_tools and with_tools.endswith(plain)
    system = [{"role": "system", "content": "Be brief."}]  # a system message of the conversation keeps its text
    assert fmt.render(system + USER, [TOOL]).startswith("<|im_start|>system\nBe brief.\n\n")
    teaches = [{"role": "system", "content": "Call calculator as <tool_call>...</tool_call>."}]
    assert fmt.render(teaches + USER, [TOOL]) == fmt.render(teaches + USER, None)  # it names the tool: no listing


def test_a_system_prompt_that_merely_mentions_a_tool_still_gets_the_listing(fmt):
    """The listing is left out only for a system prompt that describes the tools itself: each listed as JSON, or
    named beside the call format's marker. A tool's name as an ordinary word of prose (`search`, `calculator`) or
    inside another word does not teach the model the schema or the format. Negative control: before, a substring
    test left the listing out of every case below."""
    listing = json.dumps(TOOL["function"])  # what the injected prompt lists, as the tools prompt writes it
    for prose in ("You are a calculator assistant: answer carefully.", "Use the calculators in your head.",
                  'Think step by step, like a "calculator".'):
        system = [{"role": "system", "content": prose}]
        rendered = fmt.render(system + USER, [TOOL])
        assert rendered.startswith(f"<|im_start|>system\n{prose}\n\n") and listing in rendered, prose
    own = [{"role": "system", "content": 'Tools: {"name": "calculator", "parameters": {}}. Answer in JSON.'}]
    assert fmt.render(own + USER, [TOOL]) == fmt.render(own + USER, None)  # its own JSON listing: no second one
    other = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
    teaches = [{"role": "system", "content": "Call calculator as <tool_call>...</tool_call>."}]
    assert json.dumps(other["function"]) in fmt.render(teaches + USER, [TOOL, other])  # clock is not described
