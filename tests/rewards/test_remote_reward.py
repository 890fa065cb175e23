"""Remote reward services (relax.rewards.remote, `data.reward=http://...`) against a real loopback HTTP server in the
test: batched requests, the concurrency limit, retries with backoff, the per-call time limit, the key from the
environment; a service that fails, answers garbage or hangs leaves its items failed and counted, never scored 0.
Hangs and slow answers are made with Events, not sleeps."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax.config.schema import RewardServiceConfig
from relax.rewards.registry import get_reward_fn, score_responses
from relax.rewards.remote import RemoteReward, RewardServiceError


def reward_of(item: dict) -> float:
    """The service's reward in these tests: the response's length divided by 10."""
    return len(item["response"]) / 10


class Service:
    """A loopback reward service; `behave(n, items)` decides the answer of the n-th request (0-based): a dict sent as
    JSON with 200, an int status sent with an empty body, "hang up" (the connection closed without an answer), or
    None for the correct rewards."""

    def __init__(self, behave: Callable[[int, list], object] = lambda n, items: None):
        self.behave, self.requests, self.headers = behave, [], []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.release = threading.Event()  # set at the end: what still waits on it returns
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    n = len(service.requests)
                    service.requests.append(body["items"])
                    service.headers.append(dict(self.headers))
                    service.in_flight += 1
                    service.max_in_flight = max(service.max_in_flight, service.in_flight)
                try:
                    answer = service.behave(n, body["items"])
                finally:
                    # counted out before the answer is sent: once the client reads it, it may send its next request
                    with service.lock:
                        service.in_flight -= 1
                try:
                    if answer == "hang up":
                        self.close_connection = True
                        return
                    if answer is None:
                        answer = {"rewards": [reward_of(i) for i in body["items"]]}
                    if isinstance(answer, int):
                        self.send_response(answer)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    data = json.dumps(answer).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on a hung request
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service():
    made = []

    def make(behave=lambda n, items: None) -> Service:
        made.append(Service(behave))
        return made[-1]

    yield make
    for s in made:
        s.close()


def client(url: str, **options) -> RemoteReward:
    fn = get_reward_fn(url)
    assert isinstance(fn, RemoteReward)
    fn.options = RewardServiceConfig(**{"backoff_s": 0.01, **options})
    return fn


RESPONSES = [f"r{'x' * i}" for i in range(10)]
LABELS = [str(i) for i in range(10)]


def test_batches_the_items_and_returns_the_services_rewards_in_order(service):
    s = service()
    scores = score_responses(client(s.url, batch_size=3), RESPONSES, LABELS, [f"p{i}" for i in range(10)])
    assert scores.rewards == [len(r) / 10 for r in RESPONSES] and not any(scores.failed)
    assert sorted(len(items) for items in s.requests) == [1, 3, 3, 3]
    sent = sorted((i for items in s.requests for i in items), key=lambda i: int(i["label"]))
    assert sent == [{"response": r, "label": lab, "prompt": f"p{k}"}
                    for k, (r, lab) in enumerate(zip(RESPONSES, LABELS, strict=True))]


def test_requests_run_concurrency_at_a_time(service):
    two = threading.Event()

    def behave(n, items):
        with s.lock:
            if s.in_flight >= 2:
                two.set()
        assert two.wait(10), "a second request never came while the first was in flight"
        return None

    s = service(behave)
    scores = score_responses(client(s.url, batch_size=1, concurrency=2), RESPONSES, LABELS)
    assert not any(scores.failed) and len(s.requests) == 10
    assert s.max_in_flight == 2  # two at once, never three


def test_the_key_is_sent_from_the_environment_and_never_logged(service, monkeypatch, caplog):
    monkeypatch.setenv("RELAX_TEST_REWARD_KEY", "sk-test-123")
    s = service(lambda n, items: 401 if n == 0 else {"rewards": [None] * len(items)})
    fn = client(s.url, api_key_env="RELAX_TEST_REWARD_KEY", retries=0)
    with caplog.at_level(logging.DEBUG):
        scores = score_responses(fn, RESPONSES[:2], LABELS[:2])
        score_responses(fn, RESPONSES[:2], LABELS[:2])
    assert s.headers[0]["Authorization"] == "Bearer sk-test-123"
    assert "failed on a response" in caplog.text  # the failure is logged, the key is not
    assert all(scores.failed) and "sk-test-123" not in caplog.text and "sk-test-123" not in repr(fn)
    assert "sk-test-123" not in (scores.first_error or "")


def test_a_failing_service_is_retried_with_backoff_until_it_answers(service):
    s = service(lambda n, items: 503 if n < 2 else None)
    scores = score_responses(client(s.url, retries=3), RESPONSES[:4], LABELS[:4])
    assert scores.rewards == [len(r) / 10 for r in RESPONSES[:4]] and not any(scores.failed)
    assert len(s.requests) == 3


def test_a_service_that_keeps_failing_fails_its_items_never_zeros_them(service, caplog):
    s = service(lambda n, items: 500)
    fn = client(s.url, retries=2)
    scores = score_responses(fn, RESPONSES[:4], LABELS[:4])
    assert scores.failed == [True] * 4 and scores.errors == 4
    assert len(s.requests) == 3  # one try and two retries
    assert "HTTP 500" in scores.first_error and "after 3 tries" in scores.first_error
    assert fn.failed_total == 4


def test_a_hung_service_is_bounded_by_the_per_call_limit_and_counted(service):
    s = service(lambda n, items: s.release.wait() and None)  # never answers until the test ends
    fn = client(s.url, timeout_s=0.5, retries=1)
    t0 = time.monotonic()
    scores = score_responses(fn, RESPONSES[:3], LABELS[:3])
    took = time.monotonic() - t0
    assert scores.failed == [True] * 3 and "timed out" in scores.first_error
    assert len(s.requests) == 2  # retried once
    assert took < 2 * (0.5 + 1.0) + 1.0  # two tries of 0.5 s and the backoff, with slack; not the hang


def test_a_slow_answer_is_retried_and_the_retry_is_used(service):
    first_given_up = threading.Event()

    def behave(n, items):
        if n == 0:  # held until the client has retried, so it ran past its limit
            first_given_up.wait(10)
            return {"rewards": [-1.0] * len(items)}
        first_given_up.set()
        return None

    s = service(behave)
    scores = score_responses(client(s.url, timeout_s=0.5, retries=2), RESPONSES[:2], LABELS[:2])
    assert scores.rewards == [len(r) / 10 for r in RESPONSES[:2]] and not any(scores.failed)


def test_items_without_a_reward_and_malformed_answers_fail_without_a_retry(service):
    s = service(lambda n, items: {"rewards": [1.0, None, "high", float("nan") if False else 2],
                                  "errors": [None, "no test for this", None, None]})
    scores = score_responses(client(s.url), RESPONSES[:4], LABELS[:4])
    assert scores.failed == [False, True, True, False] and scores.rewards == [1.0, 0.0, 0.0, 2.0]
    assert scores.first_error == "no test for this"
    wrong = service(lambda n, items: {"rewards": [1.0]})
    scores = score_responses(client(wrong.url), RESPONSES[:3], LABELS[:3])
    assert scores.failed == [True] * 3 and "1 per item" not in scores.first_error and "3 items sent" in \
        scores.first_error
    assert len(wrong.requests) == 1  # an answer that is not the protocol is not retried


def test_past_max_errors_scoring_stops_with_a_message(service):
    s = service(lambda n, items: 500)
    fn = client(s.url, retries=0, max_errors=5)
    score_responses(fn, RESPONSES[:4], LABELS[:4])  # 4 failed: within the limit
    with pytest.raises(RewardServiceError, match=r"failed 8 items over the run, more than "
                                                 r"data.reward_service.max_errors=5"):
        score_responses(fn, RESPONSES[:4], LABELS[:4])


def test_negative_control_a_healthy_service_has_no_errors_and_the_limit_is_not_hit(service):
    s = service()
    fn = client(s.url, retries=0, max_errors=0)
    for _ in range(3):
        scores = score_responses(fn, RESPONSES, LABELS)
        assert scores.errors == 0 and scores.rewards == [len(r) / 10 for r in RESPONSES]


def test_config_problems_are_reported_together_before_start(monkeypatch):
    from relax.config.compose import load_config
    from relax.config.validate import ConfigError

    monkeypatch.delenv("RELAX_ABSENT_KEY", raising=False)

    def problems(*overrides: str) -> str:
        try:
            load_config(list(overrides))
        except ConfigError as exc:
            return str(exc)
        return ""

    text = problems("data.reward=http://127.0.0.1:8000/score", "data.reward_timeout_s=5",
                    "data.reward_service.api_key_env=RELAX_ABSENT_KEY", "data.reward_service.concurrency=0")
    assert "data.reward_timeout_s=5.0 has no effect on a reward service" in text
    assert "RELAX_ABSENT_KEY: the environment variable is not set" in text
    assert "data.reward_service.concurrency" in text
    assert "data.reward_service.batch_size=8 has no effect" in problems("data.reward_service.batch_size=8")
    assert "needs a host" in problems("data.reward=http:///score")
    assert problems("data.reward=http://127.0.0.1:8000/score") == ""


# ---------------------------------------------------------------------------------------------- in a run
RUN = ["tracking.enabled=false", "tracking.progress=false", "cluster.cpus_per_node=1", "model.dtype=float32",
       "train.save=false", "train.num_rollout=2", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
       "train.micro_batch_size=8"]


@pytest.mark.slow
def test_a_run_against_a_service_counts_its_failures_and_stops_past_the_limit(service, tmp_path, in_process):
    """relax-train data.reward=http://...: the service answers null for responses of odd length, so their groups are
    left out and counted (rollout/reward_errors = the odd-length responses, counted by the service itself), the others
    train on its rewards, and the run finishes; the same service with max_errors=0 stops the run with a message."""
    from relax.config import load_config
    from relax.runner.errors import RunError
    from relax.runner.train import run

    seen: list[list] = []

    def behave(n, items):
        seen.append(items)
        return {"rewards": [None if len(i["response"]) % 2 else reward_of(i) for i in items]}

    s = service(behave)
    result = run(load_config([f"data.reward={s.url}", "data.reward_service.batch_size=5", *RUN]),
                 output_dir=tmp_path / "a")
    errors = result.series("rollout/reward_errors")
    odd = sum(len(i["response"]) % 2 for items in seen for i in items)
    assert len(errors) == 2 and sum(errors) == odd > 0
    assert all(len(items) <= 5 for items in seen) and sum(map(len, seen)) == 32  # 2 steps of 16, in batches of 5
    dropped = result.series("rollout/reward_dropped_frac")
    assert all(d >= e / 16 for d, e in zip(dropped, errors, strict=True))  # whole groups are left out

    with pytest.raises(RunError, match=r"failed \d+ items over the run, more than data.reward_service.max_errors=0"):
        run(load_config([f"data.reward={s.url}", "data.reward_service.max_errors=0", *RUN]), output_dir=tmp_path / "b")


# ---------------------------------------------------------------------------------------------- redirects, trickles
def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """A loopback server of `handler` in a thread, and its URL (path /score)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/score"


def test_a_redirect_is_not_followed_and_the_key_goes_nowhere_else(service, monkeypatch):
    """A service that answers 302 to another address: the item fails with an error that names the status and the
    Location, and the other address sees no request of any method (urllib followed a 302 with a GET that carried the
    Bearer key); the key sent to the address that answers scores (control)."""
    monkeypatch.setenv("RELAX_TEST_REWARD_KEY", "sk-redirect-456")
    seen_elsewhere: list[tuple[str, str, object]] = []
    redirects: list[str] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def record(self):
            seen_elsewhere.append((self.command, self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = do_PUT = do_HEAD = record

        def log_message(self, *args):
            pass

    elsewhere, elsewhere_url = serve(Elsewhere)

    class Redirect(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            redirects.append(self.headers.get("Authorization"))
            self.send_response(302)
            self.send_header("Location", elsewhere_url + "?stolen")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server, url = serve(Redirect)
    try:
        fn = client(url, api_key_env="RELAX_TEST_REWARD_KEY", retries=2)
        scores = score_responses(fn, RESPONSES[:2], LABELS[:2])
    finally:
        for s in (server, elsewhere):
            s.shutdown()
            s.server_close()
    assert redirects == ["Bearer sk-redirect-456"]  # one request, not retried
    assert seen_elsewhere == []  # the key went nowhere else
    assert scores.failed == [True, True]
    assert "HTTP 302" in scores.first_error and f"redirected to {elsewhere_url}?stolen" in scores.first_error
    assert "redirects are not followed" in scores.first_error
    # control: the same key, sent to the address that answers, scores
    s = service()
    scores = score_responses(client(s.url, api_key_env="RELAX_TEST_REWARD_KEY"), RESPONSES[:2], LABELS[:2])
    assert scores.rewards == [len(r) / 10 for r in RESPONSES[:2]] and not any(scores.failed)
    assert s.headers[0]["Authorization"] == "Bearer sk-redirect-456"


class Trickle:
    """A loopback service that sends a 200 with a long Content-Length, then one byte at a time until the client hangs
    up or the test ends; `started` is set once the first byte is out, `cut` once a write failed (the client hung
    up)."""

    def __init__(self):
        self.started, self.cut, self.stop = threading.Event(), threading.Event(), threading.Event()
        trickle = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                try:
                    while True:
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        trickle.started.set()
                        if trickle.stop.wait(0.05):  # the pace of the trickle, well within the socket's time limit
                            return
                except OSError:  # broken pipe, reset: the client hung up
                    trickle.cut.set()

            def log_message(self, *args):
                pass

        self.server, self.url = serve(Handler)

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def record_workers(fn: RemoteReward) -> list[threading.Thread]:
    """The threads that run `fn`'s requests, as they start."""
    workers: list[threading.Thread] = []
    call = fn._call_with_retries

    def recorded(*args, **kwargs):
        workers.append(threading.current_thread())
        return call(*args, **kwargs)

    fn._call_with_retries = recorded
    return workers


def test_a_trickling_service_is_cut_at_the_limit_and_no_thread_outlives_the_batch():
    """Each byte comes within the socket's time limit, so only a wall-clock bound ends the request: the try is cut at
    timeout_s (its connection shut, the service sees the client hang up), the item fails with a time-out, and the
    worker thread that sent it ends (before: it read the trickle for as long as the service sent it)."""
    trickle = Trickle()
    try:
        fn = client(trickle.url, timeout_s=0.5, retries=0)
        workers = record_workers(fn)
        scores = score_responses(fn, RESPONSES[:2], LABELS[:2])
        assert trickle.started.is_set()
        assert scores.failed == [True, True] and "timed out" in scores.first_error
        assert "data.reward_service.timeout_s=0.5" in scores.first_error
        assert len(workers) == 1
        workers[0].join(timeout=10)
        assert not workers[0].is_alive(), "the worker still reads the trickle"
        assert trickle.cut.wait(10), "the service never saw the client hang up"
    finally:
        trickle.close()


def test_a_batch_past_its_bound_shuts_the_requests_still_in_flight(monkeypatch):
    """The batch's own bound (past every try's limit) shuts what is still open: a request whose per-try limit was not
    reached (the timer held off here) is ended when the batch gives up, and its thread ends."""
    import relax.rewards.remote as remote

    class NoTimer:  # the per-try limit never fires: only the batch's bound is left
        def __init__(self, *args, **kwargs):
            self.daemon = True

        def start(self):
            pass

        def cancel(self):
            pass

    trickle = Trickle()
    try:
        fn = client(trickle.url, timeout_s=0.2, retries=0, backoff_s=0.0)
        monkeypatch.setattr(remote.threading, "Timer", NoTimer)
        workers = record_workers(fn)
        scores = score_responses(fn, RESPONSES[:2], LABELS[:2])
        assert scores.failed == [True, True] and "batch's bound" in scores.first_error
        assert scores.timeouts == 2  # the bound is a time limit: a time-out (rollout/reward_timeouts)
        workers[0].join(timeout=10)
        assert not workers[0].is_alive(), "the worker still reads the trickle"
        assert trickle.cut.wait(10)
    finally:
        trickle.close()


def test_control_a_prompt_answer_within_the_limit_scores_and_leaves_no_worker(service):
    s = service()
    fn = client(s.url, timeout_s=0.5, retries=0)
    workers = record_workers(fn)
    scores = score_responses(fn, RESPONSES[:2], LABELS[:2])
    assert scores.rewards == [len(r) / 10 for r in RESPONSES[:2]] and not any(scores.failed)
    workers[0].join(timeout=10)
    assert not workers[0].is_alive()


# ---------------------------------------------------------------------------------------------- time-outs counted
TIMER = threading.Timer  # (the real one: a test replaces threading.Timer, which remote.py calls)


class Late:
    """threading.Timer whose function fires a minute late: the per-try wall-clock bound is held off, so the socket's
    own time limit (timeout_s too) fires first, as it does when the timer's thread is not scheduled in time."""

    def __init__(self, interval, function, *args, **kwargs):
        self._timer = TIMER(interval + 60.0, function, *args, **kwargs)
        self.daemon = True

    def start(self):
        self._timer.daemon = True
        self._timer.start()

    def cancel(self):
        self._timer.cancel()


class Unanswering:
    """A loopback server that accepts the connection and never answers (`kind` "silent": a listening socket nobody
    accepts from, the kernel completes the handshake and takes the request), or sends a 200's headers with a
    Content-Length and then nothing (`kind` "headers"), until the test ends."""

    def __init__(self, kind: str):
        import socket

        self.stop = threading.Event()
        self.server = None
        if kind == "silent":
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", 0))
            self.sock.listen(8)
            self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
            return
        self.sock = None
        stop = self.stop

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Length", "100")
                self.end_headers()
                self.wfile.flush()
                stop.wait(30)

            def log_message(self, *args):
                pass

        self.server, self.url = serve(Handler)

    def close(self):
        self.stop.set()
        if self.sock is not None:
            self.sock.close()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def refused_url() -> str:
    """The URL of a loopback port where nothing listens (bound, never listening: a connection is refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/score"


@pytest.mark.parametrize("timer", ["on time", "late"])
@pytest.mark.parametrize("kind", ["silent", "headers"])
def test_a_service_that_does_not_answer_in_time_counts_in_reward_timeouts(service, monkeypatch, kind, timer):
    """A service that accepts and never answers, or answers its headers and then nothing: each item fails as a
    time-out (`Scores.timeouts`, which rollout/reward_timeouts logs), whether the per-try wall-clock bound fired or
    the socket's own time limit fired first (`timer` late: a TimeoutError from urllib, recognised by type). Controls:
    a refused port and an HTTP 500 fail their items, and are not time-outs. Before: every item failed with
    'TimeoutError: timed out', and `timeouts` was 0."""
    import relax.rewards.remote as remote

    if timer == "late":
        monkeypatch.setattr(remote.threading, "Timer", Late)
    server = Unanswering(kind)
    try:
        t0 = time.monotonic()
        scores = score_responses(client(server.url, timeout_s=0.3, retries=0), RESPONSES[:3], LABELS[:3])
        took = time.monotonic() - t0
    finally:
        server.close()
    assert scores.failed == [True] * 3 and scores.timeouts == 3, scores.first_error
    assert "data.reward_service.timeout_s=0.3" in scores.first_error and took < 10

    failing = service(lambda n, items: 500)
    for url, why in ((refused_url(), "ConnectionRefusedError"), (failing.url, "HTTP 500")):
        scores = score_responses(client(url, timeout_s=5.0, retries=1), RESPONSES[:3], LABELS[:3])
        assert scores.failed == [True] * 3 and scores.timeouts == 0 and why in scores.first_error, scores.first_error


@pytest.mark.parametrize("answer", ["none", 500])
def test_the_rollout_scorer_counts_a_services_time_outs_as_a_judges(monkeypatch, answer):
    """Through the rollout's scorer (`Scorer.score`, whose Scores.timeouts train.py logs as rollout/reward_timeouts,
    as it does a judge's), with `data.reward` a service and `data.reward_service.*` from the config: the responses
    the service leaves unanswered are time-outs; the control, a service that answers them 500, fails them without
    a time-out."""
    from relax.config import load_config
    from relax.data.datasets import PromptItem
    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.runner.rollout_driver.scoring import Scorer

    from .reward_models import batch

    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
            if "7" in items[0]["response"]:
                if answer == "none":
                    stop.wait(30)
                    return
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = json.dumps({"rewards": [1.0] * len(items)}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server, url = serve(Handler)
    try:
        cfg = load_config([f"data.reward={url}", "data.reward_service.batch_size=1",
                           "data.reward_service.timeout_s=0.5", "data.reward_service.retries=0",
                           "rollout.n_samples_per_prompt=2", "tracking.enabled=false"])
        tokenizer = build_tiny_tokenizer()
        items = [PromptItem([1], "7", "repeat 7", g) for g in range(2)]
        scores = Scorer(cfg, tokenizer, get_reward_fn(cfg.data.reward), None).score(
            items, batch(tokenizer, ["7", "is", "7", "is"]))
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    assert scores.failed == [True, False, True, False] and scores.rewards[1] == 1.0
    assert scores.timeouts == (2 if answer == "none" else 0), scores.first_error


@pytest.mark.parametrize("status", [408, 504])
def test_a_services_own_408_or_504_answer_is_a_time_out(service, status):
    """The service (or a gateway before it) answers 408 Request Timeout or 504 Gateway Timeout: its items fail, as
    time-outs (Scores.timeouts, rollout/reward_timeouts), by the status. Controls: a 503 and a hang-up without an
    answer (http.client's RemoteDisconnected) fail their items without a time-out (a refused port and a 500: the
    test above). Before: 408 and 504 were failures, `timeouts` 0."""
    timing_out = service(lambda n, items: status)
    scores = score_responses(client(timing_out.url, timeout_s=5.0, retries=1), RESPONSES[:3], LABELS[:3])
    assert scores.failed == [True] * 3 and scores.timeouts == 3, scores.first_error
    assert f"HTTP {status} " in scores.first_error and len(timing_out.requests) == 2  # retried, as before
    for behave, why in ((lambda n, items: 503, "HTTP 503 "), (lambda n, items: "hang up", "RemoteDisconnected")):
        scores = score_responses(client(service(behave).url, timeout_s=5.0, retries=0), RESPONSES[:3], LABELS[:3])
        assert scores.failed == [True] * 3 and scores.timeouts == 0 and why in scores.first_error, scores.first_error


def test_is_timeout_reads_the_status_of_an_http_error_not_its_words():
    """relax.rewards.timeouts.is_timeout, the one rule of both HTTP scorers: urllib's and requests' HTTPError with 408
    or 504 are time-outs, by the status they carry; another status, or the words 'timed out' in an error of another
    kind (a refused connection, a reset), are not."""
    import email.message
    import urllib.error

    import requests

    from relax.rewards.timeouts import is_timeout

    def urllib_error(code: int, reason: str = "x") -> urllib.error.HTTPError:
        return urllib.error.HTTPError("http://127.0.0.1:1/score", code, reason, email.message.Message(), None)

    def requests_error(code: int) -> requests.HTTPError:
        response = requests.Response()
        response.status_code = code
        return requests.HTTPError(f"{code} Server Error", response=response)

    assert [is_timeout(urllib_error(c)) for c in (408, 504, 500, 503, 429, 404)] == [True, True] + [False] * 4
    assert [is_timeout(requests_error(c)) for c in (408, 504, 500, 502)] == [True, True, False, False]
    assert not is_timeout(urllib_error(500, "Gateway Timeout: timed out"))  # words are not the status
    assert not is_timeout(urllib.error.URLError(ConnectionRefusedError(111, "Connection refused (timed out)")))
    assert not is_timeout(ConnectionResetError(104, "Connection reset by peer"))
    assert not is_timeout(requests.HTTPError("504 Gateway Timeout"))  # no response: no status to read
