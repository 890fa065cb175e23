"""An answer cut by the token limit inside a multi-byte character (a byte-level vocabulary: "é" is two tokens): its
content leaves out the trailing U+FFFD that half a character decodes as, streamed or not, on the chat and the
completions route, through the official `openai` client against the training gateway over an engine that answers
"café" cut after the first byte of "é" (finish length); its tokens (log-probs) are still every sampled one.

Negative control: before this change the content was 'caf\\ufffd' (not streamed; streamed, the deltas held the
U+FFFD back and the finished answer then sent it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import _byte_level_tokenizer  # noqa: E402

from tests.openai.scripted import limits  # noqa: E402

openai = pytest.importorskip("openai")


@pytest.fixture
def cut():
    """(the official client of a gateway whose engine answers "café" cut after the first byte of "é", the ids)."""
    from relax.data.tokenizer import CHATML_TEMPLATE
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.gateway import Gateway
    from relax.serve.openai.service import OpenAIService

    tok = _byte_level_tokenizer()
    tok.chat_template = CHATML_TEMPLATE
    ids = tok.encode("café", add_special_tokens=False)[:-1]
    assert tok.decode(ids) == "caf\ufffd"

    def send(payloads):
        return [{"meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                               "finish_reason": {"type": "length", "length": len(ids)}}} for _ in payloads]

    gw = Gateway(OpenAIService(ChatFormat(tok, (tok.eos_token_id,)), send, model="m", context_length=None,
                               max_tokens=64)).start()
    session = gw.open(0, limits())
    yield openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0), ids
    gw.close()


def test_a_cut_answer_does_not_end_in_half_a_character(cut):
    client, ids = cut
    messages = [{"role": "user", "content": "Say café."}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=len(ids), logprobs=True)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == "caf"
    assert r.usage.completion_tokens == len(ids) == len(r.choices[0].logprobs.content)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=len(ids), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "caf"
    c = client.completions.create(model="m", prompt="Say café.", max_tokens=len(ids))
    assert c.choices[0].text == "caf" and c.choices[0].finish_reason == "length"
