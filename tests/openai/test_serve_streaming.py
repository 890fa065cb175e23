"""relax-serve's OpenAI streams are written as the tokens are drawn (`relax.serve.openai.deltas`), read by the official
`openai` client over real HTTP from `EmbeddedServer`s in this process:
- put together, the deltas are the answer the same request without `stream` gives (same seed): chat content,
  log-probs, finish reasons, usage and n>1 choices; completions; the Responses API's output text;
- the first delta reaches the client while the engine is still generating: the engine is held after its 4th token
  until the client has read a delta (a barrier, never a sleep; tests/README.md, "Events at a point"), and the test
  reads whether it had one then; with top_logprobs, a chunk with its tokens' alternatives (chat and the Responses
  API), each token's the likeliest of a forward pass of the model;
- a stop string is never sent, not even its start;
- a call (Hermes, a qwen3 template: tests/agents/templates.py) comes as tool_calls, never as content; a <think>
  block as reasoning_content, also when the generation prompt opened it (qwen3.5).
"""

from __future__ import annotations

import threading

import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_streaming")]

USER = [{"role": "user", "content": "What is 3 + 4?"}]
HELD_AT = 4  # the engine holds after this many tokens of a streamed request until the client has read a delta
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "enum": ["6 * 7", "1 + 1"]}},
                   "required": ["expression"], "additionalProperties": False}}}


def _server(overrides: list[str]):
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    srv = EmbeddedServer(load_config(["model=tiny", "model.dtype=float32", *overrides]), port=0, threads=1)
    srv.start()
    srv.wait_ready(120)
    return srv


@pytest.fixture(scope="module")
def server():
    srv = _server([])
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def by_choice(chunks: list, n: int, field: str = "content") -> list[str]:
    return ["".join(getattr(ch.choices[0].delta, field, None) or "" for ch in chunks
                    if ch.choices and ch.choices[0].index == i) for i in range(n)]


# ------------------------------------------------------------------------------------- the same answer, in pieces
def test_chat_deltas_put_together_are_the_unstreamed_answer(client):
    """n=2, a seed, log-probs, usage: per choice the content deltas joined, the log-probs of the chunks in order, the
    finish reason and the usage are those of the same request without stream."""
    kw = dict(model="tiny", messages=USER, n=2, seed=5, max_tokens=12, temperature=0.9, logprobs=True)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert by_choice(chunks, 2) == [c.message.content for c in plain.choices]
    for i, choice in enumerate(plain.choices):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        streamed = [(t.token, t.logprob) for c in mine if c.logprobs for t in c.logprobs.content or []]
        assert streamed == [(t.token, t.logprob) for t in choice.logprobs.content]
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        assert mine[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) > 2  # in pieces, not one


def test_completion_deltas_put_together_are_the_unstreamed_text(client):
    kw = dict(model="tiny", prompt="hello there", n=2, seed=8, max_tokens=12, logprobs=0)
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for i, choice in enumerate(plain.choices):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert "".join(c.text for c in mine) == choice.text
        assert [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs] == choice.logprobs.token_logprobs
        assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == choice.logprobs.tokens
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
    assert chunks[-1].usage == plain.usage


def per_choice(chunks: list, i: int, chat: bool) -> list[tuple]:
    """Choice i's chunks as (text, finish reason, its tokens' (token, log-prob)), alternatives left out."""
    out = []
    for c in (ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i):
        if chat:
            lps = [(t.token, t.logprob) for t in c.logprobs.content or []] if c.logprobs else None
            out.append((c.delta.content, getattr(c.delta, "reasoning_content", None), c.finish_reason, lps))
        else:
            out.append((c.text, c.finish_reason, list(zip(c.logprobs.tokens, c.logprobs.token_logprobs,
                                                          strict=True)) if c.logprobs else None))
    return out


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_stream_with_top_logprobs_is_the_incremental_one_with_the_alternatives(client, chat):
    """top_logprobs changes nothing in how the stream is cut (the engine reports the alternatives with each token):
    per choice its chunks are those of the same request streamed without them (same seed), and the alternatives of
    its chunks put together are the unstreamed answer's, token for token."""
    if chat:
        kw, make = dict(model="tiny", messages=USER, logprobs=True), client.chat.completions.create
        top = {"top_logprobs": 2}
    else:
        kw, make = dict(model="tiny", prompt="hello there", logprobs=0), client.completions.create
        top = {"logprobs": 2}
    kw.update(n=2, seed=11, max_tokens=12, temperature=0.9)
    drawn = list(make(**kw, stream=True))
    whole = list(make(**{**kw, **top}, stream=True))
    plain = make(**{**kw, **top})
    for i, choice in enumerate(plain.choices):
        assert per_choice(whole, i, chat) == per_choice(drawn, i, chat)
        assert len(per_choice(whole, i, chat)) > 3  # in pieces, not one
        mine = [ch.choices[0] for ch in whole if ch.choices and ch.choices[0].index == i and ch.choices[0].logprobs]
        if chat:
            assert [[(a.token, a.logprob) for a in t.top_logprobs] for c in mine for t in c.logprobs.content] == [
                [(a.token, a.logprob) for a in t.top_logprobs] for t in choice.logprobs.content]
        else:
            assert [alts for c in mine for alts in c.logprobs.top_logprobs] == choice.logprobs.top_logprobs


def test_responses_text_deltas_put_together_are_the_unstreamed_output(client):
    kw = dict(model="tiny", input="What is 3 + 4?", temperature=0, max_output_tokens=10)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == plain.output_text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.usage == plain.usage
    assert [e.sequence_number for e in events] == list(range(len(events)))


# ------------------------------------------------------------------------------------- before the last token
class Held:
    """The engine held after HELD_AT tokens of its next call (it asks after every token whether to stop) until the
    client has read a delta (`seen`), at most 30 s: `had` records whether it had one by then."""

    def __init__(self, srv, monkeypatch, until: threading.Event | None = None):
        self.seen, self.had = until or threading.Event(), []
        self.holding = threading.Event()  # set once the engine holds
        generate = srv.engine.generate

        def held(*args, should_abort, **kw):
            steps = [0]

            def check() -> bool:
                steps[0] += 1
                if steps[0] == HELD_AT and not self.had:
                    self.holding.set()
                    self.had.append(self.seen.wait(30))  # bounded: a stream that sends nothing yet fails here
                return should_abort()
            return generate(*args, should_abort=check, **kw)

        monkeypatch.setattr(srv.engine, "generate", held)


def text_pieces(client: openai.OpenAI, endpoint: str):
    """The text deltas of a streamed request to `endpoint`, as the client reads them (12 tokens, none a stop token);
    the connection closed when the generator is."""
    if endpoint == "chat":
        with client.chat.completions.create(model="tiny", messages=USER, seed=5, max_tokens=12, stream=True,
                                            extra_body={"ignore_eos": True}) as stream:
            for ch in stream:
                yield ch.choices[0].delta.content if ch.choices else None
    elif endpoint == "completions":
        with client.completions.create(model="tiny", prompt="hello there", seed=8, max_tokens=12, stream=True,
                                       extra_body={"ignore_eos": True}) as stream:
            for ch in stream:
                yield ch.choices[0].text if ch.choices else None
    else:
        with client.responses.create(model="tiny", input="What is 3 + 4?", temperature=0, max_output_tokens=12,
                                     stream=True) as stream:
            for e in stream:
                yield e.delta if e.type == "response.output_text.delta" else None


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_the_first_delta_arrives_while_the_engine_is_still_generating(server, client, monkeypatch, endpoint):
    hold = Held(server, monkeypatch)
    text = ""
    for piece in text_pieces(client, endpoint):
        if piece:
            hold.seen.set()
            text += piece
    assert hold.had == [True], "no delta reached the client while the engine held the request"
    assert text


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_top_logprobs_stream_with_their_tokens_as_drawn(server, client, monkeypatch, endpoint):
    """stream with top_logprobs=2 (the Responses API: its `output_text.delta` events' logprobs): the first chunk with
    alternatives reaches the client while the engine holds the request after HELD_AT tokens (the engine draws them
    with each token, as SGLang streams them). Token by token, each streamed token is the one `/generate` draws with
    the same seed, its alternatives the two likeliest of a forward pass of the model over the prompt and the tokens
    before it (log-softmax at the temperature, greedy: 1), its own log-prob its entry where it is among them; put
    together they are the unstreamed answer's. Before, relax-serve's engine computed the alternatives once the
    answer ended, and every chunk waited for it: `had == [False]`."""
    import requests
    from sglang.test_conformance import direct_logprobs

    tok, seed = server.tokenizer, 5
    hold = Held(server, monkeypatch)
    streamed = []
    if endpoint == "chat":
        temperature = 0.9
        kw = dict(model="tiny", messages=USER, seed=seed, max_tokens=12, temperature=temperature, logprobs=True,
                  top_logprobs=2, extra_body={"ignore_eos": True})
        for ch in client.chat.completions.create(**kw, stream=True):
            if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content:
                hold.seen.set()
                streamed += ch.choices[0].logprobs.content
        plain = client.chat.completions.create(**kw).choices[0].logprobs.content
    else:
        temperature = 0.0
        kw = dict(model="tiny", input=USER[0]["content"], temperature=temperature, max_output_tokens=12,
                  top_logprobs=2, include=["message.output_text.logprobs"], extra_body={"seed": seed})
        for e in client.responses.create(**kw, stream=True):
            if e.type == "response.output_text.delta" and e.logprobs:
                hold.seen.set()
                streamed += e.logprobs
        plain = client.responses.create(**kw).output[-1].content[0].logprobs
    assert hold.had == [True], "no chunk with alternatives reached the client while the engine held the request"

    def entries(content):
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in content]

    assert entries(streamed) == entries(plain) and len(streamed) >= HELD_AT
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
    sp = {"sampling_seed": seed, "temperature": temperature, "max_new_tokens": len(streamed), "ignore_eos": True}
    ids = requests.post(server.url + "/generate", json={"input_ids": prompt, "sampling_params": sp},
                        timeout=120).json()["output_ids"]
    every = direct_logprobs(server.engine.model, prompt + ids, temperature or 1.0)[len(prompt) - 1:]
    for k, (t, i) in enumerate(zip(streamed, ids, strict=True)):
        best = every[k].topk(2)
        assert t.token == tok.decode([i])
        assert [a.token for a in t.top_logprobs] == [tok.decode([int(v)]) for v in best.indices]
        assert [a.logprob for a in t.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert t.logprob == pytest.approx(float(every[k, i]), abs=1e-4)
        if i in best.indices.tolist():
            assert t.logprob == t.top_logprobs[best.indices.tolist().index(i)].logprob


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_a_client_that_leaves_mid_stream_aborts_its_rows(server, client, monkeypatch, endpoint):
    """The client reads a delta and closes the stream once the engine holds the request (after HELD_AT tokens, until
    an abort is asked, at most 30 s): its rows end with the abort before their 12 tokens, and the next request is
    answered."""
    submitted, aborts, aborted = [], [], threading.Event()
    submit, abort_where = server.scheduler.submit, server.scheduler.abort_where

    def aborting(match, message):
        aborts.append(message)
        hits = abort_where(match, message)
        aborted.set()
        return hits

    monkeypatch.setattr(server.scheduler, "submit", lambda request: (submitted.append(request), submit(request))[1])
    monkeypatch.setattr(server.scheduler, "abort_where", aborting)
    hold = Held(server, monkeypatch, until=aborted)
    pieces = text_pieces(client, endpoint)
    assert next(p for p in pieces if p)
    assert hold.holding.wait(30)  # a delta read, and the engine holds the request
    pieces.close()  # the client leaves
    (request,) = submitted
    assert request.done.wait(60) and hold.had == [True]
    assert aborts == ["the client disconnected"]
    assert [r.finish["type"] for r in request.rows] == ["abort"] and len(request.rows[0].tokens) < 12
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_an_abort_mid_stream_ends_it_with_an_error_the_client_raises(server, client, monkeypatch, endpoint):
    """/abort_request while the engine holds a stream that has sent deltas: the stream ends with an error event (the
    status was sent long before), which the official client raises, as the unstreamed request's 503 says."""
    import requests

    aborted = threading.Event()
    hold = Held(server, monkeypatch, until=aborted)
    read = ""
    with pytest.raises(openai.APIError, match="aborted the generation"):
        for piece in text_pieces(client, endpoint):
            read += piece or ""
            if read and not aborted.is_set():
                assert hold.holding.wait(30)  # a delta read, and the engine holds the request
                assert requests.post(server.url + "/abort_request", json={"abort_all": True}, timeout=60).ok
                aborted.set()
    assert hold.had == [True] and read


def test_an_agents_sdk_streamed_run_shows_text_while_the_engine_generates(server, client, monkeypatch):
    """openai-agents' `Runner.run_streamed` (the Responses API, the SDK's defaults): text delta events reach the agent
    while the engine holds the request, and put together they are the unstreamed response's text (greedy). The tiny
    model's answer is cut at max_tokens, which the SDK raises at the end of the run (a response `incomplete`)."""
    import asyncio

    from agents import Agent, ModelSettings, RunConfig, Runner
    from agents.exceptions import ModelBehaviorError
    from agents.models.openai_provider import OpenAIProvider
    from openai.types.responses import ResponseTextDeltaEvent

    agent = Agent(name="plain", instructions="Answer briefly.", model="tiny",
                  model_settings=ModelSettings(temperature=0, max_tokens=12))
    config = RunConfig(model_provider=OpenAIProvider(openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)), tracing_disabled=True)
    hold = Held(server, monkeypatch)
    text = []

    async def streamed() -> None:
        result = Runner.run_streamed(agent, "What is 3 + 4?", run_config=config)
        async for event in result.stream_events():
            if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent):
                hold.seen.set()
                text.append(event.data.delta)

    with pytest.raises(ModelBehaviorError, match="max_output_tokens"):
        asyncio.run(streamed())
    assert hold.had == [True] and len(text) > 1
    plain = client.responses.create(model="tiny", instructions="Answer briefly.", input="What is 3 + 4?",
                                    temperature=0, max_output_tokens=12)
    assert "".join(text) == plain.output_text


# ------------------------------------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_stop_string_is_never_sent_not_even_its_start(server, client, endpoint):
    """The stop string runs from the last character of one token into the next: the engine has drawn its start one
    token before it is whole, and that start must not go out. The deltas joined are the text before it, the
    unstreamed answer's."""
    if endpoint == "chat":
        base = dict(model="tiny", messages=USER, seed=5, max_tokens=16, extra_body={"ignore_eos": True})
        make, text_of = client.chat.completions.create, lambda r: r.choices[0].message.content
        pieces_of = lambda r: [t.token for t in r.choices[0].logprobs.content]  # noqa: E731
        delta_of = lambda ch: ch.choices[0].delta.content if ch.choices else None  # noqa: E731
    else:
        base = dict(model="tiny", prompt="hello there", seed=8, max_tokens=16, extra_body={"ignore_eos": True})
        make, text_of = client.completions.create, lambda r: r.choices[0].text
        pieces_of = lambda r: r.choices[0].logprobs.tokens  # noqa: E731
        delta_of = lambda ch: ch.choices[0].text if ch.choices else None  # noqa: E731
    free = make(**base, logprobs=True if endpoint == "chat" else 0)
    special = set(server.tokenizer.all_special_tokens)  # no text in the answer
    text, pieces = text_of(free), [q for q in pieces_of(free) if q not in special]
    assert "".join(pieces) == text
    ends = [len("".join(pieces[:k + 1])) for k in range(len(pieces))]
    cut = next(end for k, end in enumerate(ends[1:-1], 1)
               if pieces[k] and pieces[k + 1] and text.find(text[end - 1:end + 1]) == end - 1)
    stop = [text[cut - 1:cut + 1], "no such stop string"]
    plain = make(**base, stop=stop)
    assert text_of(plain) == text[:cut - 1]
    deltas = [d for d in (delta_of(ch) for ch in make(**base, stop=stop, stream=True)) if d]
    assert "".join(deltas) == text[:cut - 1]


# ------------------------------------------------------------------------------------- calls and reasoning
@pytest.fixture(scope="module")
def family_servers(tmp_path_factory):
    """name -> relax-serve's engine on the tiny model with the tokenizer and chat template of family `name`
    (tests/agents/templates.py), its tool parser the template's (auto: Hermes for both)."""
    from tests.agents.templates import family_tokenizer

    servers = {}
    try:
        for name in ("qwen3", "qwen3_5"):
            directory = tmp_path_factory.mktemp(name)
            family_tokenizer(name).save_pretrained(directory)
            servers[name] = _server([f"model.tokenizer={directory}"])
        yield servers
    finally:
        for srv in servers.values():
            srv.shutdown()


# Qwen3's switch: the generation prompt closes an empty <think> block, so a grammar binds from the first token (with
# thinking on, a constrained answer may reason first: tests/openai/test_reasoning_grammar.py)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def family_client(family_servers, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=family_servers[name].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_hermes_call_streams_as_tool_calls_never_as_content(family_servers):
    """A forced call (Hermes, qwen3's template; no reasoning, which would come first): the stream's call is the
    unstreamed answer's, in a tool_calls delta, and no content delta carries any of its text."""
    client = family_client(family_servers, "qwen3")
    kw = dict(model="tiny", messages=USER, tools=[CALCULATOR], seed=3, max_tokens=60, extra_body=NO_THINKING,
              tool_choice={"type": "function", "function": {"name": "calculator"}})
    plain = client.chat.completions.create(**kw)
    (call,) = plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "tool_calls" and plain.choices[0].message.content is None
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert by_choice(chunks, 1) == [""]
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [
        (0, call.function.name, call.function.arguments)]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]


def test_a_think_block_streams_as_reasoning_content(family_servers):
    """qwen3's template: an answer that opens a <think> block (the regex makes it write one; with thinking off, so
    that the regex binds from the first token) streams its reasoning as reasoning_content and the rest as content,
    neither with a tag, each the unstreamed answer's."""
    client = family_client(family_servers, "qwen3")
    kw = dict(model="tiny", messages=USER, seed=4, max_tokens=40,
              extra_body={"regex": "<think>\n[a-z]{3,8}\n</think>\n\n[a-z]{3,8}", **NO_THINKING})
    plain = client.chat.completions.create(**kw).choices[0].message
    assert plain.reasoning_content and plain.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    reasoning, content = by_choice(chunks, 1, "reasoning_content"), by_choice(chunks, 1)
    assert (reasoning, content) == ([plain.reasoning_content], [plain.content])
    assert not any("<" in (ch.choices[0].delta.content or "") + (getattr(ch.choices[0].delta, "reasoning_content",
                                                                         None) or "") for ch in chunks if ch.choices)


def test_a_block_the_generation_prompt_opened_streams_as_reasoning_as_it_comes(family_servers, monkeypatch):
    """qwen3.5's generation prompt opens <think>: the answer's text up to </think> is reasoning, and it streams while
    the engine is still generating (held after HELD_AT tokens until the client has read a reasoning delta)."""
    client = family_client(family_servers, "qwen3_5")
    kw = dict(model="tiny", messages=USER, seed=6, max_tokens=10)
    plain = client.chat.completions.create(**kw).choices[0].message
    assert plain.reasoning_content
    hold = Held(family_servers["qwen3_5"], monkeypatch)
    chunks = []
    for ch in client.chat.completions.create(**kw, stream=True):
        if ch.choices and getattr(ch.choices[0].delta, "reasoning_content", None):
            hold.seen.set()
        chunks.append(ch)
    assert hold.had == [True]
    assert by_choice(chunks, 1, "reasoning_content") == [plain.reasoning_content]
    assert by_choice(chunks, 1) == [plain.content or ""]


def test_a_responses_stream_streams_the_reasoning_as_it_comes(family_servers, monkeypatch):
    """The Responses API on qwen3.5 (its generation prompt opens <think>): the reasoning item's text streams as
    `response.reasoning_text.delta` events while the engine is still generating (held after HELD_AT tokens until
    the client has read one); the item is added before its deltas and done after them (content_part added and done
    around them), and the deltas put together are the reasoning item of the last event's response. (Sampled, with a
    seed: the tiny model's greedy answer has no text.) Before, the reasoning item came whole once the content began
    or the answer ended: the hold saw no delta (`had == [False]`)."""
    client = family_client(family_servers, "qwen3_5")
    hold = Held(family_servers["qwen3_5"], monkeypatch)
    events = []
    for e in client.responses.create(model="tiny", input="What is 3 + 4?", max_output_tokens=10, stream=True,
                                     extra_body={"seed": 6}):
        if e.type == "response.reasoning_text.delta":
            hold.seen.set()
        events.append(e)
    assert hold.had == [True], [e.type for e in events]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    first, last = kinds.index("response.reasoning_text.delta"), len(kinds) - 1 - kinds[::-1].index(
        "response.reasoning_text.delta")
    assert kinds[first - 2:first] == ["response.output_item.added", "response.content_part.added"]
    assert events[first - 2].item.type == "reasoning" and events[first - 2].output_index == 0
    assert kinds[last + 1:last + 4] == ["response.reasoning_text.done", "response.content_part.done",
                                        "response.output_item.done"]
    final = events[-1].response  # response.incomplete here: cut at max_output_tokens
    (reasoning,) = [item for item in final.output if item.type == "reasoning"]
    assert len(deltas) > 1 and "".join(deltas) == events[last + 1].text == reasoning.content[0].text
    assert reasoning.id == events[first].item_id == events[last + 3].item.id
