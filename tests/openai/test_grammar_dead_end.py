"""A grammar the tokenizer cannot write (review 5): the tiny model's own vocabulary has no token holding `"`, so a
`response_format` json_schema with a required property reaches a point, after `{`, where the grammar allows no token
at all. That request is a 400 saying so (relax-serve's OpenAI route naming `response_format`, the engine's
/generate likewise; a streamed answer ends with that error, no token drawn at the dead end in it), not a 500 blaming
the weights for the all -inf logits the mask left; other rows of the batch sample on, and the server goes on
serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
DEAD = "allows no token of this model's vocabulary"


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{engine.port}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_json_schema_the_vocabulary_cannot_write_is_a_400_naming_response_format(engine, client):
    assert '"' not in "".join(engine.tokenizer.convert_ids_to_tokens(range(len(engine.tokenizer))))
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       response_format=fmt, max_tokens=20, seed=1)
    body = caught.value.body
    assert body["param"] == "response_format" and body["code"] == "grammar_dead_end", body
    assert body["message"].startswith("response_format: constrained decoding: after 1 token(s)") and DEAD in \
        body["message"], body["message"]
    # and says why: this vocabulary has no '"', so no JSON can be written, and what to serve instead
    assert "this model's vocabulary has no token holding '\"', so no JSON" in body["message"] and \
        "serve a model whose tokenizer has one" in body["message"], body["message"]
    # streamed: the answer's tokens up to the dead end (the token drawn there is no answer's), then the error
    for seed in range(4):
        seen = []
        with pytest.raises(openai.APIError, match=DEAD):
            for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                        response_format=fmt, max_tokens=20, seed=seed, stream=True):
                seen.append(chunk.choices[0].delta.content or "")
        assert "".join(seen) == "{", (seed, seen)
    # the server goes on: a format this vocabulary can write ({} needs no quote) is answered
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_object"}, max_tokens=20, seed=1)
    assert json.loads(r.choices[0].message.content) == {}


def test_a_streamed_dead_end_is_the_same_error_as_unstreamed_on_chat_and_responses(engine, client):
    """The error a stream ends with is the one the same request unstreamed is refused with: type
    invalid_request_error, code grammar_dead_end, the param and the message (clients classify a stream's error by its
    type and code: pydantic-ai made a server_error a 500, litellm a connection error). Read by the official client
    (which raises a stream's error with its body) and, for the Responses `error` event's own fields, as sent."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": fmt,
            "max_tokens": 20, "seed": 1}
    text = {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}
    responses = {"model": "tiny", "input": "hi", "text": text, "max_output_tokens": 20, "extra_body": {"seed": 1}}
    for create, body, param in ((client.chat.completions.create, chat, "response_format"),
                                (client.responses.create, responses, "text.format")):
        with pytest.raises(openai.BadRequestError) as unstreamed:
            create(**body)
        expected = unstreamed.value.body
        assert (expected["type"], expected["code"], expected["param"]) == \
            ("invalid_request_error", "grammar_dead_end", param), expected
        with pytest.raises(openai.APIError) as streamed:
            for _ in create(**body, stream=True):
                pass
        assert streamed.value.body == expected, (streamed.value.body, expected)
        assert (streamed.value.type, streamed.value.code, streamed.value.param) == \
            ("invalid_request_error", "grammar_dead_end", param)
    # the Responses `error` event's own code, message and param (what a client reading the event, not the openai
    # package, sees)
    with client.responses.with_streaming_response.create(**responses, stream=True) as raw:
        events = [json.loads(line[len("data: "):]) for line in raw.iter_lines() if line.startswith("data: {")]
    error = events[-1]
    assert error["type"] == "error" and (error["code"], error["param"], error["message"]) == \
        ("grammar_dead_end", "text.format", expected["message"]), error


def test_a_stream_read_after_the_dead_end_still_sends_the_answer_first(engine, client, monkeypatch):
    """The stream's reader may first look at the row after the scheduler ended it at its dead end (a loaded machine:
    seen in CI): it still sends the answer's tokens (`{`), then the error, and never the token drawn at the dead
    end. The reader is held here until the request is done, so it reads only then."""
    from relax.serve.sglang.scheduler import Scheduler

    progress = Scheduler.progress

    def late(self, request):
        assert request.done.wait(60), "the request did not end"
        return progress(self, request)

    monkeypatch.setattr(Scheduler, "progress", late)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    seen = []
    with pytest.raises(openai.APIError, match=DEAD):
        for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    response_format=fmt, max_tokens=20, seed=2, stream=True):
            seen.append(chunk.choices[0].delta.content or "")
    assert "".join(seen) == "{", seen


def _generate(engine, body: dict) -> tuple[int, str]:
    """(HTTP status, body text) of POST /generate `body` to the engine."""
    request = urllib.request.Request(f"http://127.0.0.1:{engine.port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _streamed_error(engine, body: dict) -> dict:
    """The error event a streamed /generate of `body` ends with (its last event before [DONE])."""
    status, text = _generate(engine, {**body, "stream": True})
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", (status, text)
    return json.loads(events[-2])["error"]


def test_generate_answers_a_dead_end_grammar_with_a_400(engine):
    body = {"text": "hi", "sampling_params": {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 10,
                                              "sampling_seed": 1}}
    status, text = _generate(engine, body)
    assert status == 400
    error = json.loads(text)["error"]
    # it says what it is (the training gateway decides on status and code: `agent_refusal`)
    assert DEAD in error["message"] and (error["type"], error["code"]) == ("invalid_request_error", "grammar_dead_end")
    # streamed, the answer's error event is the same error, with the status the unstreamed answer has (a stream's
    # HTTP status is 200, sent before the error); so is a request refused before it starts (past the context)
    assert _streamed_error(engine, body) == {**error, "status": 400}
    long = {"text": "hi", "sampling_params": {"max_new_tokens": 10**6}}
    status, text = _generate(engine, long)
    assert status == 400 and "context" in json.loads(text)["error"]["message"], text
    # the request's fault, with no code of its own (OpenAI's context overflow is a plain invalid_request_error)
    assert (json.loads(text)["error"]["type"], json.loads(text)["error"]["code"]) == ("invalid_request_error", None)
    assert _streamed_error(engine, long) == {**json.loads(text)["error"], "status": 400}


def test_a_streamed_error_is_raised_as_its_event_says():
    """The OpenAI service reads relax-serve's engine stream through `_Aborting`: an error event is raised with the
    event's own status, type and code, not rebuilt from the request's (here a 500 without a code)."""
    from types import SimpleNamespace

    from relax.serve.openai.protocol import APIError
    from relax.serve.sglang.server import _Aborting
    from relax.serve.sglang.stream import error_event

    request = SimpleNamespace(error=None, error_status=500, error_code=None)
    sent = error_event(APIError("the engine is loading", status=503, kind="server_error", code="not_ready"))
    with pytest.raises(APIError) as raised:
        next(_Aborting(iter([sent]), request, None))
    assert (str(raised.value), raised.value.status, raised.value.kind, raised.value.code, raised.value.param) == \
        ("the engine is loading", 503, "server_error", "not_ready", None)


def test_a_dead_row_is_left_unmasked_and_ended_while_the_others_are_masked(engine):
    """`mask_logits` and `advance` on two rows of one batch: the row whose grammar allows nothing (after `{`, a
    quote) is marked dead, its logits left finite and the row ended; the other (json_object: `}` may follow `{`)
    keeps its mask and goes on."""
    from relax.rollout.grammar import Grammars, GrammarSpec, advance, json_schema_spec, mask_logits

    tok = engine.tokenizer
    grammars = Grammars(tok, len(tok))
    brace = tok.convert_tokens_to_ids("{")
    dead, live = (grammars.matcher(spec, [tok.eos_token_id])
                  for spec in (json_schema_spec(SCHEMA), GrammarSpec("json_object", "")))
    for m in (dead, live):
        assert m.accept(brace)
    logits = mask_logits(torch.zeros(2, len(tok)), [dead, live])
    assert dead.dead and not live.dead
    assert torch.isfinite(logits[0]).all()  # unmasked: the batch samples on
    assert 0 < int(torch.isfinite(logits[1]).sum()) < len(tok)  # masked as before
    closing = tok.convert_tokens_to_ids("}")
    assert advance([dead, live], torch.tensor([closing, closing]), torch.tensor([True, True])).tolist() == [True, False]


def test_the_training_gateway_answers_a_dead_end_as_relax_serve_does(engine, client):
    """On the training gateway (rollout=sglang: its calls go to the servers' /generate through
    `SGLangEngines._agent_send`, here over this embedded server's HTTP) a dead end is the 400 relax-serve gives for
    the same request: code grammar_dead_end, param the field that asked for the grammar, the same message, and not
    the servers' internal address (review-code2 finding 7). Negative control: before, `_agent_send` made it an
    APIError without code, so the gateway's 400 had code and param null and the text "POST http://127.0.0.1:<port>/
    generate: HTTP 400 {...}" (cut at 300 characters)."""
    from types import SimpleNamespace

    from relax.rollout.sglang.client import GenerateClient
    from relax.runner.rollout_driver.sglang_engines import SGLangEngines
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.gateway import Gateway
    from relax.serve.openai.service import OpenAIService
    from relax.serve.openai.sessions import Limits

    servers = GenerateClient(engine.url, request_timeout_s=60)
    engines = SimpleNamespace(_send_raw=lambda payloads, gen_id: servers.generate(payloads))  # what _agent_send uses
    fmt = ChatFormat(engine.tokenizer, engine.eos_token_ids)
    service = OpenAIService(fmt, lambda payloads: SGLangEngines._agent_send(engines, payloads), model="policy",
                            context_length=None, max_tokens=20)
    gw = Gateway(service).start()
    try:
        session = gw.open(0, Limits(max_calls=4, max_tokens=400, max_new_tokens=20, temperature=1.0, top_p=1.0,
                                    top_k=-1, seed=1))
        agent = openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0, timeout=120)
        fmt_ = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        request = {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt_, "max_tokens": 20,
                   "seed": 1}
        with pytest.raises(openai.BadRequestError) as at_gateway:
            agent.chat.completions.create(model="policy", **request)
        with pytest.raises(openai.BadRequestError) as at_serve:
            client.chat.completions.create(model="tiny", **request)
        body = at_gateway.value.body
        assert (body["type"], body["code"], body["param"]) == \
            ("invalid_request_error", "grammar_dead_end", "response_format"), body
        assert body["message"].startswith("response_format: constrained decoding: after ") and DEAD in \
            body["message"] and engine.url not in body["message"], body["message"]
        assert body == at_serve.value.body, (body, at_serve.value.body)
        # control: a format the vocabulary can write is answered through the same path
        answer = agent.chat.completions.create(model="policy", messages=request["messages"], max_tokens=20,
                                               response_format={"type": "json_object"})
        assert json.loads(answer.choices[0].message.content) == {}
    finally:
        gw.close()
