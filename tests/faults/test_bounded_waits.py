"""Every wait of a run has an end (issue 44, "Waits without an end"): the end of an MLflow run whose store hangs, the
system metrics' sampling thread, a rollout's requests, and the driver's wait on the actor while it sends weights to
SGLang servers (the weight-update group's port: tests/faults/test_weight_group_port.py).

The hangs are made by hooks that block on an Event the test holds (a store call, a monitor's reading, an actor
method), never by sleeping; each test shows the wait ends within its documented bound, says what it waited for and
for how long, and loses nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from relax.config.schema import TrackingConfig
from relax.rollout.sglang import client as client_module
from relax.rollout.sglang.client import EngineRequestError, GenerateClient
from relax.tracking import RunOptions, Tracker


# ---------------------------------------------------------------------------- the end of an MLflow run
@pytest.fixture
def tracking_cfg(fresh_store, tmp_path: Path, request: pytest.FixtureRequest) -> TrackingConfig:
    """A fresh sqlite store (tests/conftest.py) for one run."""
    return TrackingConfig(uri=f"sqlite:///{fresh_store(tmp_path)}", experiment=request.node.name[:60])


def _blocking(real: Any, release: threading.Event, entered: threading.Event, when: Any = lambda kw: True) -> Any:
    """`real`, except that a call for which `when(kwargs)` holds waits for `release` first (a store that does not
    answer); `entered` is set when one does."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if when(kwargs) and not release.is_set():
            entered.set()
            release.wait()
        return real(*args, **kwargs)

    return call


def _finish_in_thread(tracker: Tracker, bound_s: float) -> tuple[threading.Thread, float]:
    """`tracker.finish()` in a thread, joined for `bound_s`: (the thread, seconds it took or the bound)."""
    closing = threading.Thread(target=tracker.finish, daemon=True)
    t0 = time.monotonic()
    closing.start()
    closing.join(bound_s)
    return closing, time.monotonic() - t0


@pytest.mark.parametrize("hung", ["log_batch", "set_terminated"])
def test_a_store_that_hangs_while_the_writer_is_idle_does_not_hold_the_end_of_the_run(
        tracking_cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture, hung: str) -> None:
    """The writer thread is idle (nothing was due) when the run ends; the store then hangs in the final drain of the
    metrics (`log_batch`) or in the run's status call (`set_terminated`). `finish` waits CLOSE_JOIN_S for the final
    writes, not forever, says what it waited for and how long, and keeps what the store did not take in the spool;
    replayed once the store answers, the run has every value once and its status. Today's code ran the final drain
    and the status call on the caller's thread without a bound: `finish` did not return until the store answered."""
    from relax.tracking import mlflow_run
    from relax.tracking import spool as S

    bound = 0.5
    monkeypatch.setattr(mlflow_run, "CLOSE_JOIN_S", bound)
    tracker = Tracker.start(tracking_cfg, RunOptions(announce=False, spool_dir=tmp_path, background=True,
                                                     flush_interval_s=1e9, flush_every_steps=100, final_replay_s=0.2),
                            run_name="hang", params={"p": "1"})
    for step in range(3):
        tracker.log_metrics({"a": float(step)}, step)  # buffered: no flush is due, the writer thread stays idle
    release, entered = threading.Event(), threading.Event()
    real = getattr(tracker.client, hung)
    when = (lambda kw: bool(kw.get("metrics"))) if hung == "log_batch" else (lambda kw: True)
    monkeypatch.setattr(tracker.client, hung, _blocking(real, release, entered, when))
    closing, took = _finish_in_thread(tracker, bound + 30)
    try:
        assert entered.is_set(), f"the store's {hung} was never called"
        assert not closing.is_alive(), f"finish waited {took:.0f} s on a store that hangs in {hung}"
        err = capsys.readouterr().err
        assert "did not answer a write" in err and "the final writes" in err and "CLOSE_JOIN_S=0.5 s" in err, err
        assert str(tracker.spool.path) in err
        client = MlflowClient(tracking_cfg.uri)
        assert client.get_run(tracker.run_id).info.status == "RUNNING"  # the status waits in the spool
        assert tracker.spool.path.exists()
    finally:
        release.set()  # the store answers again (a hung call lands too, and writes nothing more)
    closing.join(30)
    assert S.main([str(tracker.spool.path), "--uri", tracking_cfg.uri]) == 0
    client = MlflowClient(tracking_cfg.uri)
    assert sorted(int(m.step) for m in client.get_metric_history(tracker.run_id, "a")) == [0, 1, 2]  # each once
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_a_system_metrics_sample_that_hangs_does_not_hold_the_end_of_the_run(
        tracking_cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A monitor's reading never returns (a hung GPU driver call): the sampling thread is joined for CLOSE_JOIN_S,
    not forever, a warning says what it waited for and how long, the samples logged before are kept and the run ends
    FINISHED. Today's code joined the thread without a timeout."""
    import logging

    from relax.tracking import mlflow_run

    bound = 0.5
    monkeypatch.setattr(mlflow_run, "CLOSE_JOIN_S", bound)
    caplog.set_level(logging.WARNING, logger="relax.tracking.system_metrics")
    tracker = Tracker.start(tracking_cfg, RunOptions(announce=False, spool_dir=tmp_path, background=False,
                                                     system_metrics_s=0.02), run_name="hang")
    sampler = tracker.system_metrics
    assert sampler is not None
    sampled = threading.Event()
    release, entered = threading.Event(), threading.Event()
    monitor = sampler.monitors[0]
    real_collect = monitor.collect_metrics

    def collect() -> Any:
        if sampler.samples >= 1:  # after one sample went through: the next reading hangs
            entered.set()
            release.wait()
        sampled.set()
        return real_collect()

    monkeypatch.setattr(monitor, "collect_metrics", collect)
    assert entered.wait(60), "the sampling thread never reached its second sample"
    closing, took = _finish_in_thread(tracker, bound + 30)
    try:
        assert not closing.is_alive(), f"finish waited {took:.0f} s on a system metrics sample that hangs"
        warnings = [r.getMessage() for r in caplog.records if "did not stop within 0.5 s" in r.getMessage()]
        assert len(warnings) == 1 and "sampling thread" in warnings[0], caplog.text
        client = MlflowClient(tracking_cfg.uri)
        run = client.get_run(tracker.run_id)
        assert run.info.status == "FINISHED"
        kept = [k for k in run.data.metrics if k.startswith("system/")]
        assert kept and client.get_metric_history(tracker.run_id, kept[0])  # the samples before the hang
    finally:
        release.set()
    closing.join(30)


# ---------------------------------------------------------------------------- a rollout's requests
class _Clock:
    """The client's clock (`time.monotonic` of relax.rollout.sglang.client), moved by the server below."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def slow_engine() -> Iterator[tuple[str, _Clock, list[int]]]:
    """A real HTTP server answering SGLang's /generate, each answer after 60% of the client's request timeout has
    passed on the client's clock (a long generation, without waiting for it): its URL, the clock and the requests'
    first input ids in the order they arrived."""
    clock, seen = _Clock(), []
    timeout_s = 10.0

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(int(body["input_ids"][0]))
            clock.now += 0.6 * timeout_s  # this request took 6 of the client's 10 seconds
            if body["input_ids"][0] == 99:  # an engine that fails this request (it is retried)
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            answer = json.dumps({"output_ids": [7], "meta_info": {"finish_reason": {"type": "stop"},
                                                                  "output_token_logprobs": [[-0.5, 7, None]],
                                                                  "weight_version": "1"}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", clock, seen
    server.shutdown()
    server.server_close()


def test_request_timeout_is_each_requests_own_not_one_for_the_whole_rollout(slow_engine, monkeypatch) -> None:
    """Four requests, one at a time (max_in_flight=1), each answered after 6 s of a 10 s request timeout: each is
    within its own bound, so the rollout succeeds, in 24 s of the client's clock. Today's code gave the whole batch one
    10 s deadline, and the third request failed though no request took longer than 6 s. A request that keeps failing
    still fails once its own bound has passed, naming the setting."""
    url, clock, seen = slow_engine
    monkeypatch.setattr(client_module, "time", clock)
    client = GenerateClient(url, request_timeout_s=10.0, max_in_flight=1)
    answers = client.generate([{"input_ids": [i, 5]} for i in range(4)])
    assert len(answers) == 4 and all(a["output_ids"] == [7] for a in answers)
    assert sorted(seen) == [0, 1, 2, 3] and clock.now == pytest.approx(1000.0 + 4 * 6.0)
    assert client.retries == 0

    # the bound holds per request: one that keeps failing is retried until 10 s after its first attempt, not forever
    with pytest.raises(EngineRequestError, match=r"not answered within 10 s .*rollout\.sglang\.request_timeout_s"):
        client.generate([{"input_ids": [99, 5]}])
    assert client.retries == 2 and seen[-2:] == [99, 99]  # at 0 s and 6 s of its own clock; none after 12 s
