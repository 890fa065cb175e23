"""The training gateway's answer to a /generate request the servers refused (`agent_refusal`), decided on the engine's
answer that `EngineRequestError` carries (its HTTP status and body), not on a pattern over the error's text. The
errors are made by the real client code (`GenerateClient._one`, `post`) over answers given in-process (no server);
the bodies are in the shape relax's engine answers (`tests/openai/test_grammar_dead_end.py` checks that shape on the
engine and the whole path over HTTP)."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
import requests

from relax.rollout.grammar import DEAD_END
from relax.rollout.sglang import client as sglang_client
from relax.rollout.sglang.client import EngineRequestError, GenerateClient
from relax.runner.rollout_driver.sglang_engines import agent_refusal
from relax.serve.openai.protocol import APIError

CODE = "grammar_dead_end"  # the code relax's engine and relax-serve give a dead end (their wire string)
URL = "http://10.0.0.7:30000"  # the servers' internal address, which the agent must not see in a dead end's answer


class _Answer:
    """aiohttp's answer, as `_one` reads it."""

    def __init__(self, status: int, text: str):
        self.status, self._text = status, text

    async def __aenter__(self) -> _Answer:
        return self

    async def __aexit__(self, *exc) -> bool:
        return False

    async def text(self) -> str:
        return self._text


class _Session:
    """aiohttp's session: every POST answers `status` with `text`, or raises `error`."""

    def __init__(self, status: int = 0, text: str = "", error: Exception | None = None):
        self.status, self.text, self.error = status, text, error

    def post(self, url: str, json: dict, timeout) -> _Answer:
        assert url == URL + "/generate"
        if self.error is not None:
            raise self.error
        return _Answer(self.status, self.text)


def sent(session: _Session) -> EngineRequestError:
    """The error `GenerateClient` raises for one /generate request the session answers (retried answers: out of time
    at once)."""
    servers = GenerateClient(URL, request_timeout_s=0.05)
    with pytest.raises(EngineRequestError) as caught:
        asyncio.run(servers._one(session, {"input_ids": [1]}, asyncio.Semaphore(1)))
    return caught.value


def test_the_gateway_decides_on_the_engines_status_and_code():
    # a dead end: relax's engine's 400 with code grammar_dead_end; its body is past the 300 characters the error's
    # text keeps, whose cut loses the message's tail: the answer's message is the engine's, whole
    dead = DEAD_END.format(n=12)
    body = json.dumps(APIError(dead, code=CODE).body())
    exc = sent(_Session(400, body))
    assert (exc.status, exc.body, exc.error_code, exc.error_message) == (400, body, CODE, dead)
    assert len(body) > 300 and str(exc) == f"POST {URL}/generate: HTTP 400 {body[:300]}" and dead[-40:] not in str(exc)
    err = agent_refusal(exc)
    assert (err.status, err.kind, err.code, err.param, str(err)) == \
        (400, "invalid_request_error", CODE, None, dead)
    # survives pickling (an error that crosses a process) with what the engine answered
    again = pickle.loads(pickle.dumps(exc))
    assert (str(again), again.status, again.body) == (str(exc), 400, body)

    # a 400 whose message merely quotes the dead end's text, without the code, is not one: the agent's bad request
    quoted = json.dumps(APIError(f"stop: {DEAD_END.format(n=3)}").body())
    exc = sent(_Session(400, quoted))
    err = agent_refusal(exc)
    assert exc.status == 400 and exc.error_code is None
    assert (err.status, err.kind, err.code, str(err)) == (400, "invalid_request_error", None, str(exc))
    # the code at another status (a 500 that says grammar_dead_end) is not one either: the servers' failure
    exc = EngineRequestError(f"POST {URL}/generate: HTTP 500 x", status=500,
                             body=json.dumps(APIError(dead, status=500, code=CODE).body()))
    assert (agent_refusal(exc).status, agent_refusal(exc).code) == (503, None)

    # another 400 (relax's engine's invalid request; SGLang's shapes): the agent's bad request, with the text as today
    for other in (json.dumps(APIError("sampling_params.min_p: expected a number").body()),
                  json.dumps({"object": "error", "message": "bad input", "code": 400}), "Bad Request"):
        exc = sent(_Session(400, other))
        err = agent_refusal(exc)
        assert exc.status == 400 and exc.error_code in (None, 400), other
        assert (err.status, err.kind, err.code, str(err)) == (400, "invalid_request_error", None, str(exc)), other

    # the servers' failure (503 server_error): a 503 answer, a 429 retried out of time, a connection that fails,
    # none of which is an HTTP error the engine answered for good (status None)
    for session, last in ((_Session(503, '{"error": {"message": "no worker"}}'), "HTTP 503"),
                          (_Session(429, "Too Many Requests"), "HTTP 429"),
                          (_Session(error=ConnectionRefusedError("refused")), "ConnectionRefusedError")):
        exc = sent(session)
        err = agent_refusal(exc)
        assert exc.status is None and exc.body == "" and exc.error == {} and last in str(exc), str(exc)
        assert (err.status, err.kind, err.code, str(err)) == (503, "server_error", None, str(exc))


def test_post_carries_the_status_and_body_and_sglangs_error_shapes_are_read(monkeypatch):
    """`post`'s HTTP error carries the status and whole body (its text cut as before); a connection error none.
    `{"error": "..."}` (SGLang's missing key) reads as its message."""
    answer = requests.models.Response()
    answer.status_code, answer._content = 401, json.dumps({"error": "Unauthorized" + "!" * 600}).encode()
    monkeypatch.setattr(sglang_client.requests, "post", lambda *a, **k: answer)
    with pytest.raises(EngineRequestError) as caught:
        sglang_client.post(URL, "/flush_cache")
    exc = caught.value
    assert str(exc) == f"POST {URL}/flush_cache: HTTP 401 {answer.text[:500]}" and len(answer.text) > 500
    assert (exc.status, exc.body, exc.error_message, exc.error_code) == \
        (401, answer.text, "Unauthorized" + "!" * 600, None)
    assert (agent_refusal(exc).status, agent_refusal(exc).kind) == (400, "invalid_request_error")

    def refused(*a, **k):
        raise requests.ConnectionError("refused")

    monkeypatch.setattr(sglang_client.requests, "post", refused)
    with pytest.raises(EngineRequestError) as caught:
        sglang_client.post(URL, "/flush_cache")
    assert caught.value.status is None and agent_refusal(caught.value).status == 503
