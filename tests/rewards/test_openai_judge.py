"""A judge behind an OpenAI-compatible URL (relax.rewards.openai_judge, reward_model=judge reward_model.engine=openai)
against a loopback server in the test: each try is bounded by reward_model.timeout_s of wall-clock time even when the
server trickles its answer (the socket's read timeout alone never fires then) or its headers, and its connection is
closed; an answer stopped at max_tokens (finish_reason "length") is a parse failure, not a score; a failing judge is
warned of on the console like a failed data.reward call, without its key.

The server trickles by waiting on an Event between bytes: the test sets it at its end, so nothing outlives the test.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

import relax.rewards.openai_judge as openai_judge
from relax.config import load_config
from relax.data.datasets import PromptItem
from relax.data.tokenizer import build_tiny_tokenizer
from relax.rewards.openai_judge import OpenAIJudge
from relax.runner.reward_model import make_scorer, reward_model_metrics
from relax.runner.rollout_driver.scoring import Scorer

from .reward_models import batch

KEY = "sk-judge-secret-42"
KEY_ENV = "RELAX_TEST_OPENAI_JUDGE_KEY"


class Judge:
    """A loopback chat-completions server; `behave(question)` is its answer: ("content", finish_reason), an int HTTP
    status (the body echoes the request's Authorization header, as careless servers do), "trickle" / "trickle
    headers" (a byte every `gap_s` until the test ends), or "cut" (one byte of the answer, then the connection
    closed)."""

    def __init__(self, behave: Callable[[str], object], gap_s: float = 0.05):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.stop = threading.Event()
        self.client_gone = threading.Event()  # a trickled answer's write failed: the client closed the connection
        judge = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers: the client's pool reuses connections

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answer = behave(body["messages"][0]["content"])
                try:
                    if answer in ("trickle", "trickle headers"):
                        self._trickle(answer == "trickle headers")
                        return
                    if answer == "cut":  # the answer's first byte of 100, then the connection closed
                        self.send_response(200)
                        self.send_header("Content-Length", "100")
                        self.end_headers()
                        self.wfile.write(b"{")
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    if isinstance(answer, int):
                        data, code = json.dumps({"error": f"bad key {self.headers.get('Authorization')}"}), answer
                    else:
                        content, finish = answer
                        data, code = json.dumps({"choices": [{"message": {"role": "assistant", "content": content},
                                                              "finish_reason": finish}]}), 200
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data.encode())))
                    self.end_headers()
                    self.wfile.write(data.encode())
                except OSError:
                    pass

            def _trickle(self, headers: bool) -> None:
                try:
                    if headers:
                        self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    else:
                        self.send_response(200)
                        self.send_header("Content-Length", "100000")
                        self.end_headers()
                    while not judge.stop.wait(gap_s):
                        self.wfile.write(b"X-Slow: 1\r\n" if headers else b" ")
                        self.wfile.flush()
                except OSError:
                    judge.client_gone.set()
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Judge]]:
    started: list[Judge] = []

    def start(behave: Callable[[str], object], **kw) -> Judge:
        started.append(Judge(behave, **kw))
        return started[-1]

    yield start
    for judge in started:
        judge.close()


def client(url: str, timeout_s: float, **kw) -> OpenAIJudge:
    return OpenAIJudge(url, model=None, api_key_env=kw.pop("api_key_env", None), max_new_tokens=8, temperature=0.0,
                       timeout_s=timeout_s, concurrency=kw.pop("concurrency", 2))


def answered_within(judge: OpenAIJudge, questions: list[str], limit_s: float):
    """judge.answer(questions), which must return within `limit_s` (else the test fails rather than hangs), and the
    seconds it took."""
    waiter = ThreadPoolExecutor(1)
    t0 = time.monotonic()
    future = waiter.submit(judge.answer, questions)
    try:
        result = future.result(timeout=limit_s)
    except TimeoutError:
        pytest.fail(f"the judge's answer did not return within {limit_s} s (reward_model.timeout_s not kept)")
    finally:
        waiter.shutdown(wait=False)  # (a call still hung ends when the server stops, at the test's end)
    return result, time.monotonic() - t0


# ------------------------------------------------------------------------------------------- the time limit


@pytest.mark.parametrize("how", ["trickle", "trickle headers"])
def test_a_trickling_judge_fails_at_timeout_s_and_its_connection_is_closed(serve, monkeypatch, how):
    """Each byte arrives well within the socket's read timeout (1 s), so only a wall-clock limit ends the try."""
    monkeypatch.setattr(openai_judge, "RETRIES", 0)
    server = serve(lambda q: how if q == "slow" else ("7", "stop"))
    judge = client(server.url, timeout_s=1.0)
    try:
        (answers, errors, cut, late), took = answered_within(judge, ["slow", "fast"], limit_s=20)
    finally:
        judge.close()
    assert 1.0 <= took < 3.0, took
    assert answers == [None, "7"] and cut == [False, False] and late == [True, False]
    assert "no answer within reward_model.timeout_s=1" in errors[0] and errors[1] is None
    assert server.client_gone.wait(10)  # the try's socket was closed, not left to the server's next write


def test_retries_each_get_the_limit_and_the_pool_serves_on_after_a_timeout(serve, monkeypatch):
    monkeypatch.setattr(openai_judge, "RETRIES", 1)
    monkeypatch.setattr(openai_judge, "BACKOFF_S", 0.1)
    seen: list[str] = []
    server = serve(lambda q: seen.append(q) or ("trickle" if q == "slow" else ("3", "stop")))
    judge = client(server.url, timeout_s=0.5, concurrency=1)
    try:
        (answers, errors, _, late), took = answered_within(judge, ["slow"], limit_s=20)
        assert answers == [None] and late == [True] and seen == ["slow", "slow"] and 1.0 <= took < 3.0, took
        # the connection that timed out was discarded: the next requests are answered
        (answers, errors, _, late), _ = answered_within(judge, ["a", "b", "c"], limit_s=20)
    finally:
        judge.close()
    assert answers == ["3", "3", "3"] and errors == [None] * 3


def test_control_a_slow_answer_within_the_limit_is_answered(serve, monkeypatch):
    """The limit is the try's wall-clock time, not a shorter one: an answer taking ~0.3 s within 5 s is kept."""
    monkeypatch.setattr(openai_judge, "RETRIES", 0)
    done = threading.Event()

    def behave(q):
        done.wait(0.3)  # (the server's slowness, not the test's synchronisation)
        return ("8", "stop")

    server = serve(behave)
    judge = client(server.url, timeout_s=5.0)
    try:
        result, _ = answered_within(judge, ["q"] * 4, limit_s=20)
    finally:
        judge.close()
    assert result[0] == ["8"] * 4 and result[1] == [None] * 4


class LateDeadline(openai_judge._Deadline):
    """The try's wall-clock watch fires a minute late: the socket's own read timeout (timeout_s too) fires first, as
    it does when the watch's timer thread is not scheduled in time."""

    def __init__(self, seconds: float):
        super().__init__(seconds + 60.0)


def test_a_read_that_times_out_while_the_answer_streams_is_a_time_out(serve, monkeypatch):
    """The headers arrive, then nothing (the server's next byte is a minute away): the socket's read timeout fires
    in the body, where requests raises a ConnectionError wrapping urllib3's ReadTimeoutError, not its Timeout. It is
    a time-out by type (`is_timeout`), counted late, with the time-out's message. Controls: an answer cut short by
    the server closing (requests' ChunkedEncodingError), and a refused connection (a ConnectionError; urllib3's
    NewConnectionError in it is a ConnectTimeoutError by class), are failures, not time-outs. Before: late was
    False, the error 'ConnectionError: ... Read timed out.'."""
    import socket

    monkeypatch.setattr(openai_judge, "RETRIES", 0)
    monkeypatch.setattr(openai_judge, "_Deadline", LateDeadline)
    server = serve(lambda q: "trickle" if q == "slow" else ("7", "stop"), gap_s=60.0)
    judge = client(server.url, timeout_s=0.5)
    try:
        (answers, errors, _, late), took = answered_within(judge, ["slow", "fast"], limit_s=20)
    finally:
        judge.close()
    assert answers == [None, "7"] and late == [True, False], errors
    assert "no answer within reward_model.timeout_s=0.5" in errors[0] and took < 10

    cut = serve(lambda q: "cut")
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    for url, why in ((cut.url, "ChunkedEncodingError: "), (closed, "ConnectionError: ")):
        judge = client(url, timeout_s=5.0)
        try:
            (answers, errors, _, late), _ = answered_within(judge, ["q"], limit_s=20)
        finally:
            judge.close()
        assert answers == [None] and late == [False] and why in errors[0], errors


@pytest.mark.parametrize("status", [408, 504])
def test_a_408_or_504_answer_is_a_time_out(serve, monkeypatch, status):
    """The server (or a gateway before it) answers 408 or 504: the question fails as a time-out (late), by the
    status. The control: a 503 fails it without a time-out. Before: late was False for both."""
    monkeypatch.setattr(openai_judge, "RETRIES", 0)
    server = serve(lambda q: status if q == "slow" else (503 if q == "busy" else ("7", "stop")))
    judge = client(server.url, timeout_s=5.0)
    try:
        (answers, errors, _, late), _ = answered_within(judge, ["slow", "busy", "fast"], limit_s=20)
    finally:
        judge.close()
    assert answers == [None, None, "7"] and late == [True, False, False], errors
    assert f"HTTP {status}:" in errors[0] and "HTTP 503:" in errors[1]


# ------------------------------------------------------------------------------------------- cut answers


def judge_config(url: str, *extra: str):
    return load_config(["reward_model=judge", "reward_model.engine=openai", f"reward_model.url={url}",
                        "reward_model.template=\"judge {response}\"", "rollout.n_samples_per_prompt=2",
                        "data.reward_timeout_s=null", "tracking.enabled=false", *extra])


def score_with(cfg, responses: list[str]):
    tokenizer = build_tiny_tokenizer()
    items = [PromptItem([1], "7", "repeat 7", g) for g in range(len(responses) // 2)]
    scorer = make_scorer(cfg, None)
    try:
        return Scorer(cfg, tokenizer, None, scorer).score(items, batch(tokenizer, responses))
    finally:
        scorer.close()


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_an_answer_stopped_at_max_tokens_is_a_parse_failure_not_a_score(serve, finish):
    """The reviewer's case: "Let me check the 2 claims in" read 2.0 when the judge was cut off mid-sentence. With
    finish_reason "stop" (the control) the same text is the judge's whole answer and scores 2."""
    server = serve(lambda q: ("Let me check the 2 claims in", finish) if "7" in q else ("9", "stop"))
    cfg = judge_config(server.url, "data.reward=none")
    scores = score_with(cfg, ["7", "is", "is", "is"])
    metrics = reward_model_metrics(cfg, scores.model_scores, scores.parse_failures, scores.model_time)
    if finish == "length":
        assert scores.failed == [True, False, False, False] and scores.parse_failures == 1
        assert metrics["rollout/judge_parse_fail_frac"] == 0.25
        assert "cut at reward_model.max_new_tokens=" in scores.first_error
    else:
        assert scores.failed == [False] * 4 and scores.rewards == [2.0, 9.0, 9.0, 9.0]
        assert metrics["rollout/judge_parse_fail_frac"] == 0.0 and scores.first_error is None


@pytest.mark.parametrize("slow", ["trickle", 500])
def test_a_judge_call_that_times_out_counts_in_reward_timeouts(serve, monkeypatch, slow):
    """A judge call with no answer within reward_model.timeout_s is a reward time-out (rollout/reward_timeouts,
    train.py's Scores.timeouts), as a data.reward call past data.reward_timeout_s is; the control, a judge that
    refuses the same calls (HTTP 500), fails them without a time-out."""
    monkeypatch.setattr(openai_judge, "RETRIES", 0)
    server = serve(lambda q: slow if "7" in q else ("5", "stop"))
    scores = score_with(judge_config(server.url, "data.reward=none", "reward_model.timeout_s=1"),
                        ["7", "is", "7", "is"])
    assert scores.failed == [True, False, True, False]
    assert scores.timeouts == (2 if slow == "trickle" else 0)


# ------------------------------------------------------------------------------------------- warned


def test_a_judge_that_refuses_every_request_is_warned_of_without_its_key(serve, monkeypatch, caplog):
    """HTTP 401 on every request: the console says so (once per batch, as for data.reward), the key masked even where
    the server echoes it; the control, a judge that answers, warns of nothing."""
    monkeypatch.setenv(KEY_ENV, KEY)
    server = serve(lambda q: 401)
    cfg = judge_config(server.url, "data.reward=none", f"reward_model.api_key_env={KEY_ENV}")
    with caplog.at_level(logging.WARNING, logger="relax"):
        scores = score_with(cfg, ["7", "is", "7", "is"])
    warned = [r.getMessage() for r in caplog.records if "reward_model=judge failed" in r.getMessage()]
    assert scores.failed == [True] * 4 and len(warned) == 1, caplog.text
    assert "HTTP 401" in warned[0] and "left out of the loss" in warned[0] and "***" in warned[0]
    assert KEY not in caplog.text and KEY not in scores.first_error

    caplog.clear()
    good = serve(lambda q: ("1", "stop"))
    with caplog.at_level(logging.WARNING, logger="relax"):
        scores = score_with(judge_config(good.url, "data.reward=none", f"reward_model.api_key_env={KEY_ENV}"),
                            ["7", "is", "7", "is"])
    assert scores.failed == [False] * 4 and "failed on a response" not in caplog.text


def test_a_judge_that_never_answers_a_score_is_warned_of(serve, caplog):
    server = serve(lambda q: ("no idea", "stop"))
    with caplog.at_level(logging.WARNING, logger="relax"):
        scores = score_with(judge_config(server.url, "data.reward=none"), ["7", "is"])
    assert scores.parse_failures == 2
    assert "reward_model=judge failed on a response (its group is left out of the loss): the judge's answer holds " \
           "no score" in caplog.text
