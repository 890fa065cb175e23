"""The context-length 400 in OpenAI's words, so that clients tell it from other 400s (review-agents3 finding 2): the
`code` (context_length_exceeded) and `param` as before, the message OpenAI's (and vLLM's) wording first, then what
Relax adds. Read through the official `openai` client against relax-serve's routes over a scripted engine.

The phrases the clients match (their source, not installed here; the versions the review ran):
- litellm 1.110.2, litellm/litellm_core_utils/exception_mapping_utils.py, `is_error_str_context_window_exceeded`
  (lines 99-112): "this model's maximum context length is" (lower-cased message) among its known substrings, which
  makes `ContextWindowExceededError` (what Router's context_window_fallbacks and agents' history compaction catch).
- langchain-openai 1.8.1, langchain_openai/chat_models/base.py, `_handle_openai_bad_request` (lines 684-692):
  `"context_length_exceeded" in str(e)` (openai 3.63's str(e) is "Error code: 400 - <message>", without the code,
  so this misses OpenAI's own 400 too) or `"prompt is too long" in e.message`, which makes
  `OpenAIContextOverflowError`. Relax's prompt-past-the-context message says so (true there); the max_tokens form
  does not (the prompt alone fits), as OpenAI's does not.
OpenAI's own wording (as its API answers it): "This model's maximum context length is 4097 tokens. However, your
messages resulted in 4113 tokens. Please reduce the length of the messages." and "This model's maximum context
length is 4097 tokens. However, you requested 4203 tokens (3703 in the messages, 500 in the completion). Please reduce
the length of the messages or completion."

Negative control: before this change the messages were "the prompt (N tokens) fills the model's context of C tokens"
and "max_tokens=M plus the prompt (N tokens) exceeds the model's context of C tokens": the litellm phrase assertions
fail.
"""

from __future__ import annotations

import pytest

from tests.agents.templates import base_tokenizer
from tests.openai.plain_http import plain_server
from tests.openai.scripted import Script

openai = pytest.importorskip("openai")

LITELLM = "this model's maximum context length is"  # in is_error_str_context_window_exceeded's substrings
LANGCHAIN = "prompt is too long"  # _handle_openai_bad_request: in e.message
CONTEXT = 64


def test_a_prompt_past_the_context_is_openais_message_with_the_code_and_param():
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.service import OpenAIService

    tok = base_tokenizer()
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    script = Script(fmt, ["7"])
    service = OpenAIService(fmt, script, model="m", context_length=CONTEXT)
    long = [{"role": "user", "content": "a " * 200}]
    prompt = len(fmt.prompt(long, None, None))
    short = [{"role": "user", "content": "Hi"}]
    room = CONTEXT - len(fmt.prompt(short, None, None))
    assert prompt > CONTEXT and room > 1
    with plain_server(service) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="m", messages=long)
        body = caught.value.body
        assert (body["code"], body["param"], body["type"]) == \
            ("context_length_exceeded", "messages", "invalid_request_error"), body
        assert body["message"] == (
            f"This model's maximum context length is {CONTEXT} tokens. However, your messages resulted in {prompt} "
            "tokens. Please reduce the length of the messages. (The prompt is too long: it fills the model's "
            "context, leaving no room for an answer.)")
        assert LITELLM in caught.value.message.lower() and LANGCHAIN in caught.value.message

        asked = room + 5
        for stream in (False, True):  # refused before anything is sampled, streamed or not
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model="m", messages=short, max_tokens=asked, stream=stream)
            body = caught.value.body
            assert (body["code"], body["param"]) == ("context_length_exceeded", "max_tokens"), body
            used = CONTEXT - room
            assert body["message"] == (
                f"This model's maximum context length is {CONTEXT} tokens. However, you requested {used + asked} "
                f"tokens ({used} in the messages, {asked} in the completion). Please reduce the length of the "
                f"messages or completion. (The completion's tokens are max_tokens={asked}; without max_tokens the "
                f"answer may take the {room} tokens left.)")
            assert LITELLM in caught.value.message.lower()
        # what the message says holds: without max_tokens the answer is sampled within the room left
        r = client.chat.completions.create(model="m", messages=short)
        assert r.choices[0].message.content == "7" and script.calls[-1][0]["sampling_params"]["max_new_tokens"] == room


def test_the_responses_and_completions_routes_name_their_own_fields_in_the_text_and_param():
    """The same 400 on /v1/responses names `input` and `max_output_tokens` (its fields; `max_tokens` is no field of
    it), streamed or not, and on /v1/completions `prompt` (review-code2 finding 6a): the message's text and its
    `param` name the same field. Negative control: before, the Responses text said "max_tokens=..., without
    max_tokens" and "your messages" under param max_output_tokens / input, and completions said "your messages" with
    param `messages`."""
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.service import OpenAIService

    tok = base_tokenizer()
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    service = OpenAIService(fmt, Script(fmt, ["7"]), model="m", context_length=CONTEXT)
    used = len(fmt.prompt([{"role": "user", "content": "Hi"}], None, None))
    room, asked = CONTEXT - used, CONTEXT - used + 5
    long_text = "a " * 200
    long = len(fmt.prompt([{"role": "user", "content": long_text}], None, None))
    with plain_server(service) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.APIError) as caught:
                for _ in client.responses.create(model="m", input="Hi", max_output_tokens=asked, stream=stream) \
                        if stream else [client.responses.create(model="m", input="Hi", max_output_tokens=asked)]:
                    pass
            body = caught.value.body
            assert (body["code"], body["param"]) == ("context_length_exceeded", "max_output_tokens"), body
            assert body["message"] == (
                f"This model's maximum context length is {CONTEXT} tokens. However, you requested {used + asked} "
                f"tokens ({used} in the input, {asked} in the completion). Please reduce the length of the input or "
                f"completion. (The completion's tokens are max_output_tokens={asked}; without max_output_tokens the "
                f"answer may take the {room} tokens left.)"), body["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="m", input=long_text)
        body = caught.value.body
        assert (body["code"], body["param"]) == ("context_length_exceeded", "input"), body
        assert body["message"].startswith(
            f"This model's maximum context length is {CONTEXT} tokens. However, your input resulted in {long} tokens. "
            "Please reduce the length of the input. (The prompt is too long"), body["message"]

        prompt = len(tok.encode("a " * 200))
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="m", prompt="a " * 200)
        body = caught.value.body
        assert (body["code"], body["param"]) == ("context_length_exceeded", "prompt"), body
        assert body["message"].startswith(
            f"This model's maximum context length is {CONTEXT} tokens. However, your prompt resulted in {prompt} "
            "tokens. Please reduce the length of the prompt."), body["message"]
        assert LITELLM in body["message"].lower() and LANGCHAIN in body["message"]
