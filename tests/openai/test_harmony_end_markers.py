"""gpt-oss (harmony): an end marker is never content (review 5, A4's second half). With tools offered, the chat route
reads the answer with the stop token that ended it put back (a call's `<|call|>` tells a complete call from one the
token limit cut); where that stop token, or an end marker, stands outside any message, the parser used to return it as
the content: `"<|return|>"` after a call when `<|call|>` is not a stop token (the case of review 5's A4), after an
answer that ends with its reasoning, or after plain text from a model that ignores the format. Echoed back, such a
content puts a literal `<|return|>` into the next prompt. The official client through the training gateway, a
scripted engine (a random tiny model never writes harmony)."""

from __future__ import annotations

import json

import pytest

from tests.agents.templates import gpt_oss_tokenizer
from tests.openai.harmony_turns import CALLING, TOOLS, USER

openai = pytest.importorskip("openai")


def answers(stops: tuple[str, ...], texts: list[str]):
    """(the official client on a gateway whose engine answers `texts` in turn, ending each with its last stop token
    as the engine does, the stop tokens being `stops`), and a closer."""
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.gateway import Gateway
    from relax.serve.openai.service import OpenAIService
    from tests.openai.scripted import limits

    tok = gpt_oss_tokenizer()
    fmt = ChatFormat(tok, tuple(tok.convert_tokens_to_ids(s) for s in stops))
    ids = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
    sent: list[int] = []

    def send(payloads: list[dict]) -> list[dict]:
        sent.append(1)
        out = ids[len(sent) - 1]
        return [{"meta_info": {"output_token_logprobs": [[-0.01, t, None] for t in out],
                               "finish_reason": {"type": "stop"}, "weight_version": "0"}}]

    gw = Gateway(OpenAIService(fmt, send, model="policy", context_length=None, max_tokens=64)).start()
    session = gw.open(0, limits())
    return openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0), gw.close


def test_a_call_followed_by_return_is_the_call_without_content():
    """Stop tokens `<|return|>` only (no `<|call|>`): the model goes on after its call and ends with `<|return|>`."""
    client, close = answers(("<|return|>",), [CALLING + "<|return|>"])
    try:
        choice = client.chat.completions.create(model="m", messages=USER, tools=TOOLS).choices[0]
    finally:
        close()
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert not choice.message.content, choice.message.content


@pytest.mark.parametrize("text,content", [
    ("<|channel|>analysis<|message|>Need the weather.<|end|><|return|>", ""),  # ends with its reasoning
    ("Sunny in Paris.<|return|>", "Sunny in Paris."),  # ignores the format
    ("<|channel|>final<|message|>Sunny.<|end|><|return|>", "Sunny."),  # ends its message, then the answer
])
def test_an_answer_without_a_call_has_no_end_marker_in_its_content(text, content):
    client, close = answers(("<|return|>", "<|call|>"), [text])
    try:
        message = client.chat.completions.create(model="m", messages=USER, tools=TOOLS).choices[0].message
    finally:
        close()
    assert (message.content or "") == content and not message.tool_calls
