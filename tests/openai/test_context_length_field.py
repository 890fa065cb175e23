"""The context-length 400 of a prompt and its answer's token limit past the context names the field the request sent
the limit in (`param` and the message): `max_completion_tokens` (what the openai SDK documents, `max_tokens` being
deprecated, and what langchain-openai 1.x sends for `ChatOpenAI(max_tokens=...)`), `max_tokens`, and where both came,
the smaller one, which is the limit. Through the official `openai` client against the chat route over a scripted
engine, streamed and not.

Negative control: before, every such 400 named max_tokens (`param` and message), a field the request had not sent.
"""

from __future__ import annotations

import pytest

from tests.agents.templates import base_tokenizer
from tests.openai.plain_http import plain_server
from tests.openai.scripted import Script

openai = pytest.importorskip("openai")

CONTEXT = 64


def test_the_context_length_400_names_the_limit_field_the_request_sent():
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.service import OpenAIService

    tok = base_tokenizer()
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    service = OpenAIService(fmt, Script(fmt, ["7"]), model="m", context_length=CONTEXT)
    short = [{"role": "user", "content": "Hi"}]
    used = len(fmt.prompt(short, None, None))
    room = CONTEXT - used
    # (what the request sends, the field expected named, its value)
    cases = [({"max_completion_tokens": room + 5}, "max_completion_tokens", room + 5),
             ({"max_tokens": room + 5}, "max_tokens", room + 5),
             ({"max_tokens": room + 9, "max_completion_tokens": room + 5}, "max_completion_tokens", room + 5),
             ({"max_tokens": room + 5, "max_completion_tokens": room + 9}, "max_tokens", room + 5)]
    with plain_server(service) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        for sent, field, asked in cases:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as caught:
                    client.chat.completions.create(model="m", messages=short, stream=stream, **sent)
                body = caught.value.body
                assert (body["code"], body["param"]) == ("context_length_exceeded", field), (sent, body)
                assert body["message"].endswith(
                    f"({used} in the messages, {asked} in the completion). Please reduce the length of the messages "
                    f"or completion. (The completion's tokens are {field}={asked}; without {field} the answer may "
                    f"take the {room} tokens left.)"), (sent, body["message"])
        # the control: a limit that fits is honoured, whichever field sent it
        r = client.chat.completions.create(model="m", messages=short, max_completion_tokens=room)
        assert r.choices[0].message.content == "7"
