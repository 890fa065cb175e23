"""A streamed request with `top_logprobs` is written as its tokens are drawn, each chunk with its tokens' alternatives,
as OpenAI and SGLang stream them, where the engine's stream events carry the alternatives (SGLang's streamed
`output_top_logprobs`, one list per token so far); before, such a request's stream was written only once the whole
answer was generated. Read by the official `openai` client over real HTTP (relax's event-stream writer) from an
`OpenAIService` over a scripted engine whose answer is drawn from the request's seed: the chunks' content and their
log-probs with alternatives put together are the unstreamed answer of the same seeded request, token for token, and
the first chunk with alternatives reaches the client while the engine still holds the answer's last token (a
barrier: the engine waits for the client's first such chunk, never a sleep). relax-serve's own engine draws the
alternatives with each token and streams them so too (tests/openai/test_serve_streaming.py,
`test_top_logprobs_stream_with_their_tokens_as_drawn`).

Negative control: with `OpenAIService._incremental` refusing top_logprobs again (the old code), the engine's `send`
answered the request whole and the client had no chunk before the last token
(`test_each_chunk_carries_its_alternatives_as_drawn` failed on `assert engine.had == [True]`: [False]).
"""

from __future__ import annotations

import json
import random
import threading

import pytest

from relax.agents.parsers import get_parser
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import QWEN3, _byte_level_tokenizer
from tests.openai.plain_http import plain_server

openai = pytest.importorskip("openai")

WORDS = ["alpha", " beta", " gamma", " delta", " é", " 漢字", " seven", "!"]
USER = [{"role": "user", "content": "Say something."}]


class Engine:
    """/generate: six words drawn from `random.Random(sampling_seed)`, then the stop token; token k's log-prob
    -(k+1)/10, its alternatives itself and the next byte one lower. `stream` sends each token with its log-prob and
    alternatives (SGLang's cumulative events), and before the last one waits until the client has read a chunk with
    alternatives (`seen`, at most 10 s); `had` records whether it had by then. `send` (a whole answer) records it
    too: no client could have a chunk then."""

    def __init__(self, fmt: ChatFormat):
        self.fmt, self.seen, self.had = fmt, threading.Event(), []

    def answer(self, payload: dict) -> dict:
        rng = random.Random(payload["sampling_params"].get("sampling_seed", 0))
        ids = self.fmt.encode("".join(rng.choice(WORDS) for _ in range(6))) + [self.fmt.tokenizer.eos_token_id]
        pairs = [[-(k + 1) / 10, t, None] for k, t in enumerate(ids)]
        top = payload.get("top_logprobs_num") or 0
        meta = {"output_token_logprobs": pairs, "finish_reason": {"type": "stop"}, "weight_version": "0"}
        if top:
            meta["output_top_logprobs"] = [[[lp, t, None], [lp - 1, (t + 1) % 256, None]][:top] for lp, t, _ in pairs]
        return {"meta_info": meta}

    def send(self, payloads: list[dict]) -> list[dict]:
        self.had.append(self.seen.wait(10))
        return [self.answer(p) for p in payloads]

    def stream(self, payloads: list[dict]):
        answers = [self.answer(p) for p in payloads]

        def events():
            for i, a in enumerate(answers):
                pairs = a["meta_info"]["output_token_logprobs"]
                top = a["meta_info"].get("output_top_logprobs")
                for k in range(1, len(pairs)):
                    meta = {"output_token_logprobs": pairs[:k], "finish_reason": None}
                    if top:
                        meta["output_top_logprobs"] = top[:k]
                    yield {"index": i, "meta_info": meta}
                if top:  # the answer's last token: held until the client has read a chunk with alternatives
                    self.had.append(self.seen.wait(10))
                yield {"index": i, **a}

        return events()


@pytest.fixture
def served():
    """(the official client, the engine) of an OpenAIService over an `Engine` (byte-level vocabulary, Qwen3's
    template) on a loopback port."""
    tok = _byte_level_tokenizer()
    tok.chat_template = QWEN3
    fmt = ChatFormat(tok, (tok.eos_token_id,), get_parser("hermes", tok))
    engine = Engine(fmt)
    try:
        with plain_server(OpenAIService(fmt, engine.send, model="m", context_length=None,
                                        stream=engine.stream)) as url:
            yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60), engine
    finally:
        engine.seen.set()  # (a failing test leaves no engine waiting)


def test_each_chunk_carries_its_alternatives_as_drawn(served):
    client, engine = served
    kw = dict(model="m", messages=USER, seed=4, logprobs=True, top_logprobs=2)
    chunks = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            engine.seen.set()
    assert engine.had == [True]  # a chunk with alternatives reached the client before the answer's last token
    plain = client.chat.completions.create(**kw)

    def entries(content):
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in content]

    mine = [ch.choices[0] for ch in chunks if ch.choices]
    assert "".join(c.delta.content or "" for c in mine) == plain.choices[0].message.content
    streamed = [e for c in mine if c.logprobs for e in entries(c.logprobs.content or [])]
    assert streamed == entries(plain.choices[0].logprobs.content)
    assert all(len(alts) == 2 for _, _, alts in streamed)
    assert sum(1 for c in mine if c.logprobs and c.logprobs.content) > 3  # one chunk per token's text, not one
    assert json.dumps(streamed) != json.dumps(entries(client.chat.completions.create(
        **{**kw, "seed": 5}).choices[0].logprobs.content))  # the seed draws the answer


def test_a_completion_stream_carries_its_alternatives_as_drawn(served):
    client, engine = served
    kw = dict(model="m", prompt="hi", seed=4, logprobs=2, max_tokens=40)
    chunks = []
    for chunk in client.completions.create(**kw, stream=True):
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.top_logprobs:
            engine.seen.set()
    assert engine.had == [True]
    plain = client.completions.create(**kw).choices[0]
    mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain.text
    assert [alts for c in mine for alts in c.logprobs.top_logprobs] == plain.logprobs.top_logprobs
    assert [lp for c in mine for lp in c.logprobs.token_logprobs] == plain.logprobs.token_logprobs
    assert len(mine) > 3
