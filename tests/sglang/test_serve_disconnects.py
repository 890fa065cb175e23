"""relax-serve (`EmbeddedServer`, in this process, real HTTP) and its clients: a request whose client leaves before its
answer is aborted and frees the engine (`relax.serve.http.Departures`), one whose client stays runs to its
end; errors in OpenAI's shape, read by the official `openai` client; a wrong method answered 405 with Allow.

The departure happens at a point of the generation with hooks in this process (tests/README.md, "Events at a point"):
the engine holds after its first token until the test lets it go, so that the client leaves (or stays) while its rows
are in the engine; what the server did is read from the scheduler's rows, not from how long anything took."""

from __future__ import annotations

import http.client
import json
import threading

import httpx
import openai
import pytest
import requests

import relax.serve.http as http_module

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_disconnects")]

MAX = 16  # tokens asked for: the held engine has drawn one when the client leaves
USER = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def server():
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    srv = EmbeddedServer(load_config(["model=tiny", "model.dtype=float32"]), port=0, threads=1)
    srv.start()
    srv.wait_ready(120)
    yield srv
    srv.shutdown()


class Hooks:
    """The engine held after the first token of its next call until `release`; the requests submitted; the aborts
    asked of the scheduler; the looks at client connections that found the client there."""

    def __init__(self, srv, monkeypatch):
        self.started, self.release = threading.Event(), threading.Event()
        self.aborted, self.looked = threading.Event(), threading.Event()
        self.submitted, self.aborts, self.stays = [], [], 0
        generate, submit, abort_where = srv.engine.generate, srv.scheduler.submit, srv.scheduler.abort_where
        left = http_module.client_left

        def held(*args, should_abort, **kw):
            def check() -> bool:  # the engine asks after every token whether to stop
                if not self.started.is_set():
                    self.started.set()
                    self.release.wait(60)  # bounded: a broken test fails on its assertions instead of hanging
                return should_abort()
            return generate(*args, should_abort=check, **kw)

        def submitted(request):
            self.submitted.append(request)
            submit(request)

        def aborting(match, message):
            self.aborts.append(message)
            hits = abort_where(match, message)
            self.aborted.set()
            return hits

        def looking(sock) -> bool:
            gone = left(sock)
            if not gone:
                self.stays += 1
                if self.stays >= 3:  # the monitor looked at the connection three times, the client there each time
                    self.looked.set()
            return gone

        monkeypatch.setattr(srv.engine, "generate", held)
        monkeypatch.setattr(srv.scheduler, "submit", submitted)
        monkeypatch.setattr(srv.scheduler, "abort_where", aborting)
        monkeypatch.setattr(http_module, "client_left", looking)


def ask(endpoint: str, stream: bool) -> tuple[str, dict]:
    if endpoint == "generate":
        return "/generate", {"input_ids": [5, 6, 7], "stream": stream,
                             "sampling_params": {"max_new_tokens": MAX, "temperature": 1.0, "ignore_eos": True}}
    body = {"model": "tiny", "messages": USER, "max_tokens": MAX, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}  # the tokens, counted by the server
    return "/v1/chat/completions", body


def send(srv, path: str, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn


def tokens_answered(endpoint: str, stream: bool, raw: bytes) -> tuple[int, str]:
    """(tokens, finish reason) of an answer as the client read it."""
    if not stream:
        answer = json.loads(raw)
        if endpoint == "generate":
            return len(answer["output_ids"]), answer["meta_info"]["finish_reason"]["type"]
        return answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    if endpoint == "generate":
        return len(events[-1]["output_ids"]), events[-1]["meta_info"]["finish_reason"]["type"]
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    return events[-1]["usage"]["completion_tokens"], finish[-1]


CASES = [("generate", False), ("generate", True), ("chat", False), ("chat", True)]


@pytest.mark.parametrize("endpoint, stream", CASES)
def test_a_client_that_leaves_is_aborted_and_frees_the_engine(server, monkeypatch, endpoint, stream):
    """The client closes its connection while the engine holds its rows: the server aborts them (the monitor asks
    the scheduler, and the rows end with the abort after the token they had), and the next request is answered."""
    hooks = Hooks(server, monkeypatch)
    conn = send(server, *ask(endpoint, stream))
    assert hooks.started.wait(60)
    conn.close()  # the client gives up
    assert hooks.aborted.wait(60), "the departure was not noticed"
    hooks.release.set()
    (request,) = hooks.submitted
    assert request.done.wait(60)
    assert hooks.aborts == ["the client disconnected"]
    for row in request.rows:
        assert row.finish == {"type": "abort", "message": "the client disconnected"}
        assert len(row.tokens) < MAX
    nxt = requests.post(server.url + "/generate", timeout=120,
                        json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert nxt.status_code == 200 and len(nxt.json()["output_ids"]) == 2


@pytest.mark.parametrize("endpoint, stream", CASES)
def test_negative_control_a_client_that_stays_gets_its_whole_answer(server, monkeypatch, endpoint, stream):
    """The same request, its client connected while the engine holds it (the monitor looks at the connection three
    times meanwhile): nothing is aborted, and the answer has all its tokens."""
    hooks = Hooks(server, monkeypatch)
    conn = send(server, *ask(endpoint, stream))
    assert hooks.started.wait(60)
    assert hooks.looked.wait(60)
    hooks.release.set()
    response = conn.getresponse()
    assert response.status == 200
    assert tokens_answered(endpoint, stream, response.read()) == (MAX, "length")
    conn.close()
    assert hooks.aborts == [] and [r.finish["type"] for r in hooks.submitted[0].rows] == ["length"]


# ----------------------------------------------------------------- the training gateway in front of the engine
@pytest.fixture
def gateway(server):
    """A training gateway (`relax.serve.openai.gateway`) whose service sends to this server over real HTTP, as the
    rollout's gateway sends to its SGLang servers, and aborts by rid there; a session opened; the aborts it asked."""
    from relax.agents.parsers import get_parser
    from relax.rollout.sglang.client import GenerateClient, post
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.gateway import Gateway, WatchedSend
    from relax.serve.openai.service import OpenAIService
    from relax.serve.openai.sessions import Limits

    asked: list[list[str]] = []

    def abort(rids: list[str]) -> None:
        asked.append(rids)
        for rid in rids:
            post(server.url, "/abort_request", {"rid": rid})

    watched = WatchedSend(GenerateClient(server.url, request_timeout_s=120).generate, abort)
    fmt = ChatFormat(server.tokenizer, server.eos_token_ids, get_parser("hermes", server.tokenizer))
    gw = Gateway(OpenAIService(fmt, watched, model="policy", context_length=None, max_tokens=MAX),
                 watched=watched).start()
    session = gw.open(0, Limits(max_calls=4, max_tokens=400, max_new_tokens=MAX, temperature=1.0, top_p=1.0,
                                top_k=-1, seed=0))
    yield gw, session, asked
    gw.close()


def gateway_call(gw, session, monkeypatch) -> tuple[http.client.HTTPConnection, threading.Event]:
    """A chat call of the session's agent, sent; the event is set once the gateway has handled it (answered or
    failed: whatever it records, it has recorded)."""
    handled, handle = threading.Event(), gw.handle

    def handling(*args):
        try:
            return handle(*args)
        finally:
            handled.set()

    monkeypatch.setattr(gw, "handle", handling)
    conn = http.client.HTTPConnection(gw.host, gw.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "policy", "messages": USER}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {session.key}"})
    return conn, handled


def test_the_gateway_aborts_the_call_of_an_agent_that_left(server, gateway, monkeypatch):
    """An agent killed at its time limit (or whose client timed out) closes its connection while the engine holds its
    call: the gateway aborts that call's request on the engine by its rid (the engine ends it after the token it
    had, and serves the next), and the session records no answer: the agent never saw it. (Without the gateway's
    watch, `watched=None`, no abort comes: checked when this test was written.)"""
    gw, session, asked = gateway
    hooks = Hooks(server, monkeypatch)
    conn, handled = gateway_call(gw, session, monkeypatch)
    assert hooks.started.wait(60)
    conn.close()  # the agent is gone
    assert hooks.aborted.wait(60), "the departure was not noticed"
    hooks.release.set()
    (request,) = hooks.submitted
    assert request.done.wait(60) and handled.wait(60)
    assert asked == [[row.rid for row in request.rows]] and asked[0][0].startswith("relax-gateway-")
    assert hooks.aborts == ["aborted by /abort_request"]
    assert [row.finish["type"] for row in request.rows] == ["abort"] and len(request.rows[0].tokens) < MAX
    assert session.nodes == [] and session.trajectory() is None  # admitted (it counts to max_calls), not recorded


def test_negative_control_the_gateway_answers_an_agent_that_stays(server, gateway, monkeypatch):
    gw, session, asked = gateway
    hooks = Hooks(server, monkeypatch)
    conn, handled = gateway_call(gw, session, monkeypatch)
    assert hooks.started.wait(60)
    assert hooks.looked.wait(60)
    hooks.release.set()
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["object"] == "chat.completion"
    conn.close()
    assert handled.wait(60)
    assert asked == [] and hooks.aborts == [] and len(session.nodes) == 1


# ------------------------------------------------------------------------------------------------------ errors

SHAPE = {"message", "type", "param", "code"}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_unknown_paths_and_bad_bodies_answer_in_openais_shape(server, client):
    """The official client reads type and code of the errors; a bad JSON body, a body that is not an object."""
    with pytest.raises(openai.NotFoundError) as err:
        client.post("/nope", body={}, cast_to=httpx.Response)
    assert err.value.status_code == 404 and err.value.type == "invalid_request_error"
    assert err.value.code == "not_found" and "/v1/nope" in err.value.message
    for path in ("/v1/chat/completions", "/generate"):
        for raw in (b"{nope", b"[1, 2]"):
            r = requests.post(server.url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=60)
            assert r.status_code == 400 and set(r.json()["error"]) == SHAPE, (path, raw, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
    # the control: the same path and client with a good body answers
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).object == "chat.completion"


def test_a_wrong_method_is_405_with_allow(server, client):
    """GET /v1/chat/completions is refused as a method (not read as a POST without its fields), with Allow."""
    for method, path, allow in (("GET", "/v1/chat/completions", "POST"), ("GET", "/v1/completions", "POST"),
                                ("PUT", "/v1/responses", "POST"), ("POST", "/v1/models", "GET"),
                                ("DELETE", "/v1/models/tiny", "GET"), ("DELETE", "/generate", "GET, POST, PUT")):
        r = requests.request(method, server.url + path, timeout=60)
        assert r.status_code == 405 and r.headers["Allow"] == allow, (method, path, r.status_code, r.text)
        assert set(r.json()["error"]) == SHAPE and r.json()["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.APIStatusError) as err:
        client.get("/chat/completions", cast_to=httpx.Response)
    assert err.value.status_code == 405 and err.value.code == "method_not_allowed"
    # the control: the right methods on the same paths
    assert requests.get(server.url + "/v1/models", timeout=60).status_code == 200
    assert requests.get(server.url + "/v1/models/tiny", timeout=60).status_code == 200
    r = requests.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2},
                      timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
