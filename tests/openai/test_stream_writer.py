"""One writer of OpenAI streams: a stream written once its answer is finished (a training session's, a request with
top_logprobs, an engine that does not stream) goes through the same code as one written as its tokens are drawn
(`relax.serve.openai.deltas`), so for the same answer its chunks are the same, its deltas put together are the
unstreamed answer, and its chunks' log-probs put together are the unstreamed `logprobs` entry for entry (alternatives
included), also when a token has no text of its own (a special token inside the answer, the case the old whole-answer
writer misaligned). The engine is scripted (fixed answers on a byte-level vocabulary, every token its own log-prob);
the gateway's stream is read by the official `openai` client."""

from __future__ import annotations

import json

import pytest

from relax.agents.parsers import get_parser
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import QWEN3, _byte_level_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
SPECIAL = "<|endoftext|>"  # a special token: no text of its own, its log-prob entry written out
ANSWERS = [
    f"Hello{SPECIAL} world é 漢",
    f"<think>\nhm{SPECIAL} ok\n</think>\n\nThe answer{SPECIAL} is 7.",
    f"Let me{SPECIAL} call. {CALL}",
    "  opens with blank: held whole to the end",  # the role chunk's content stays "" (not the whole text again)
]
USER = [{"role": "user", "content": "What is 3 + 4?"}]


def _format() -> ChatFormat:
    tok = _byte_level_tokenizer()
    tok.chat_template = QWEN3  # <think> blocks: an answer may open one
    return ChatFormat(tok, (tok.eos_token_id,), get_parser("hermes", tok))


class Engine:
    """/generate over a fixed answer `text` (then the stop token): token k's log-prob -(k+1)/100, its alternatives
    (itself, then the next byte one lower) when top_logprobs_num asks; `send` answers whole, `stream` token by token
    (each token an event, then the finished answer)."""

    def __init__(self, fmt: ChatFormat, text: str):
        self.ids = fmt.encode(text) + [fmt.tokenizer.eos_token_id]

    def answer(self, payload: dict) -> dict:
        pairs = [[-(k + 1) / 100, t, None] for k, t in enumerate(self.ids)]
        meta = {"output_token_logprobs": pairs, "finish_reason": {"type": "stop"}, "weight_version": "0"}
        if payload.get("top_logprobs_num"):
            meta["output_top_logprobs"] = [[[lp, t, None], [lp - 1, (t + 1) % 256, None]][:payload["top_logprobs_num"]]
                                           for lp, t, _ in pairs]
        return {"meta_info": meta}

    def send(self, payloads: list[dict]) -> list[dict]:
        return [self.answer(p) for p in payloads]

    def stream(self, payloads: list[dict]):
        answers = self.send(payloads)

        def events():
            for i, a in enumerate(answers):
                pairs = a["meta_info"]["output_token_logprobs"]
                for k in range(1, len(pairs)):
                    yield {"index": i, "meta_info": {"output_token_logprobs": pairs[:k], "finish_reason": None}}
                yield {"index": i, **a}

        return events()


def service(text: str, incremental: bool) -> OpenAIService:
    fmt = _format()
    engine = Engine(fmt, text)
    return OpenAIService(fmt, engine.send, model="m", context_length=None,
                         stream=engine.stream if incremental else None)


def chunks_of(status_body) -> list[dict]:
    """The chunks of an answered stream (an `EventStream`, or an `EventSource` written as it comes)."""
    status, body = status_body
    assert status == 200
    raw = bytes(body) if isinstance(body, bytes) else b"".join(body.blocks)
    events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [{k: v for k, v in json.loads(e).items() if k not in ("id", "created")} for e in events[:-1]]
    for ch in chunks:  # a call's id is random: drawn anew for every answer
        for c in ch["choices"]:
            for tc in (c.get("delta") or {}).get("tool_calls") or []:
                tc["id"] = "call"
    return chunks


def without_alternatives(chunks: list[dict]) -> list[dict]:
    out = json.loads(json.dumps(chunks))
    for ch in out:
        for c in ch["choices"]:
            lp = c.get("logprobs") or {}
            for entry in lp.get("content") or []:
                entry["top_logprobs"] = []
            if "top_logprobs" in lp:
                lp["top_logprobs"] = None
    return out


@pytest.mark.parametrize("text", ANSWERS)
def test_a_finished_chat_answer_streams_as_the_incremental_one_with_its_log_probs_in_order(text):
    body = dict(model="m", messages=USER, tools=TOOLS, n=2, seed=3, logprobs=True, stream=True,
                stream_options={"include_usage": True})
    drawn = chunks_of(service(text, incremental=True).chat(body))
    whole = chunks_of(service(text, incremental=False).chat(body))  # the gateway's path: the engine answers whole
    assert whole == drawn
    top = chunks_of(service(text, incremental=False).chat({**body, "top_logprobs": 2}))
    assert without_alternatives(top) == drawn
    plain = service(text, incremental=False).chat({**body, "stream": False, "stream_options": None,
                                                   "top_logprobs": 2})[1]
    for i, choice in enumerate(plain["choices"]):
        mine = [ch["choices"][0] for ch in top if ch["choices"] and ch["choices"][0]["index"] == i]
        assert [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]] == choice["logprobs"]["content"]
        message = choice["message"]
        assert mine[0]["delta"] == {"role": "assistant", "content": None if message["content"] is None else ""}
        for field in ("content", "reasoning_content"):
            assert "".join(c["delta"].get(field) or "" for c in mine) == (choice["message"].get(field) or "")
        assert [tc for c in mine for tc in c["delta"].get("tool_calls") or []] == [
            {"index": k, **tc, "id": "call"} for k, tc in enumerate(choice["message"].get("tool_calls") or [])]
    assert (SPECIAL in text) == (SPECIAL in [e["token"] for e in plain["choices"][0]["logprobs"]["content"]])
    assert top[-1]["usage"] == plain["usage"]


@pytest.mark.parametrize("text", ANSWERS[:1])
def test_a_finished_completion_streams_as_the_incremental_one_with_its_log_probs_in_order(text):
    body = dict(model="m", prompt="hi", n=2, seed=3, logprobs=0, stream=True, stream_options={"include_usage": True})
    drawn = chunks_of(service(text, incremental=True).completion(body))
    assert chunks_of(service(text, incremental=False).completion(body)) == drawn
    top = chunks_of(service(text, incremental=False).completion({**body, "logprobs": 2}))
    assert without_alternatives(top) == drawn
    plain = service(text, incremental=False).completion({**body, "stream": False, "stream_options": None,
                                                         "logprobs": 2})[1]
    for i, choice in enumerate(plain["choices"]):
        mine = [ch["choices"][0] for ch in top if ch["choices"] and ch["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
            assert [x for c in mine if c["logprobs"] for x in c["logprobs"][key]] == choice["logprobs"][key], key
    assert top[-1]["usage"] == plain["usage"]


def test_a_gateway_session_stream_with_a_special_token_keeps_its_log_probs_in_order(scripted_gateway):
    """A training session's stream (written once the answer is generated), read by the official client: the chunks'
    log-probs put together are the unstreamed answer's, token for token, the special token's included; the session
    records the same tokens either way."""
    fmt = _format()
    text = ANSWERS[0]
    gw, script, session, client = scripted_gateway(fmt, [text])
    plain = client.chat.completions.create(model="m", messages=USER, logprobs=True)
    chunks = list(client.chat.completions.create(model="m", messages=USER, logprobs=True, stream=True))
    streamed = [(t.token, t.logprob) for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content or []]
    assert streamed == [(t.token, t.logprob) for t in plain.choices[0].logprobs.content]
    assert SPECIAL in [t for t, _ in streamed]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == plain.choices[0].message.content
    assert script.ids(0) == script.ids(1)
