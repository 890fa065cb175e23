"""An HTTP MLflow server that stops answering mid-run: the flush before a checkpoint does not wait for it.

A real `mlflow server` process behind a TCP proxy of the test's own, which forwards, or holds every request it gets
and never answers (a server that hangs, or a network that drops packets: the client waits for its time-out, then
MLflow's own retries). The outage is placed by the test (the proxy switched at a given step, a request seen held),
never by a sleep.

Before: `Tracker.flush` (the runner's, before each checkpoint) drained in the caller, behind the writer thread's
write in progress, so the checkpoint and the whole run waited for MLflow's HTTP retries: about 4 minutes per request
with MLflow's defaults, then again for the spool's replay, with no message. Now it waits `FLUSH_WAIT_S` at most, then
puts the metrics into the spool (fsync'ed) with one warning; the writer thread writes them when the server answers
again, each value once. And Relax bounds MLflow's HTTP retries in its process where the user has not set them."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from relax.config.schema import TrackingConfig
from relax.tracking import RunOptions, Tracker, run_writer

pytestmark = pytest.mark.slow  # starts an mlflow server (tests/README.md)

TRACKER_LOGGER = "relax.tracking.mlflow_run"
WAIT_S = 1.0  # FLUSH_WAIT_S in these tests
# MLflow's variables for its HTTP client (mlflow.environment_variables), read at each request
HTTP_VARS = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT")
# what `mlflow server` (uvicorn) logs once it listens: the port it bound
RUNNING_ON = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory, mlflow_template) -> Iterator[int]:
    """`mlflow server` on a copy of the migrated empty store; its port. It binds port 0 and its uvicorn says the
    port the kernel gave it: a port picked free and bound later could be taken by another worker's process."""
    import shutil

    directory = tmp_path_factory.mktemp("mlflow-server")
    shutil.copyfile(mlflow_template, directory / "mlflow.db")
    log = open(directory / "server.log", "w")
    # close_fds (Popen's default): the server must not inherit the CPU lock's descriptor of a flock'ed test run
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{directory / 'mlflow.db'}", "--default-artifact-root",
                             str(directory / "artifacts"), "--host", "127.0.0.1", "--port", "0",
                             "--workers", "1"], cwd=directory, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    try:
        deadline, port = time.monotonic() + 120, None
        while True:  # its port, then its readiness: polled (not placing an event: waiting for one)
            if port is None and (said := RUNNING_ON.search((directory / "server.log").read_text(errors="replace"))):
                port = int(said.group(1))
            if port is not None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    pass
            assert proc.poll() is None, (directory / "server.log").read_text()
            assert time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.2)
        yield port
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
        log.close()


class Proxy:
    """127.0.0.1:`port` in front of the server. `hang()`: from then on every request (on new connections and on the
    kept-alive ones) is read and never answered or forwarded, and `held` is set; `back()`: forwarding again, the
    held connections closed (their requests fail at once and are retried by the client)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.hanging = False
        self.held = threading.Event()
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", self.upstream))
        except OSError:
            conn.close()
            return
        threading.Thread(target=self._pump, args=(up, conn), daemon=True).start()
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                break
            if not data:
                break
            if self.hanging:  # the request is taken and never answered
                with self._lock:
                    self._held.append(conn)
                self.held.set()
                up.close()
                return
            try:
                up.sendall(data)
            except OSError:
                break
        for s in (up, conn):
            s.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def hang(self) -> None:
        self.hanging = True

    def back(self) -> None:
        self.hanging = False
        with self._lock:
            held, self._held = self._held, []
        for conn in held:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.back()
        self.listener.close()


@pytest.fixture
def proxy(mlflow_server: int) -> Iterator[Proxy]:
    p = Proxy(mlflow_server)
    yield p
    p.close()


@pytest.fixture
def policy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's HTTP variables unset (as for a user who set none), and put back as they were after the test."""
    for name in HTTP_VARS:
        monkeypatch.delenv(name, raising=False)


def test_the_flush_before_a_checkpoint_does_not_wait_for_a_store_that_hangs(
        proxy: Proxy, policy_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # while the store answers, the flush waits as long as a loaded machine needs (a write slower than WAIT_S would be
    # spooled, as it should, and the "nothing in the spool" check below would fail on the machine, not on the code)
    monkeypatch.setattr(run_writer, "FLUSH_WAIT_S", 60.0, raising=False)  # raising=False: the negative control
    cfg = TrackingConfig(uri=f"http://127.0.0.1:{proxy.port}", experiment="http-outage")
    tracker = Tracker.start(cfg, RunOptions(announce=False, spool_dir=tmp_path, background=True, flush_every_steps=1,
                                            flush_interval_s=1e9, final_replay_s=60), run_name="outage")
    delivered: list[tuple[str, int]] = []  # every metric value the store took, through the run's own client
    real = tracker.client.log_batch

    def log_batch(run_id: str, *args: Any, **kwargs: Any) -> Any:
        out = real(run_id, *args, **kwargs)
        delivered.extend((m.key, int(m.step)) for m in kwargs.get("metrics") or ())
        return out

    monkeypatch.setattr(tracker.client, "log_batch", log_batch)
    for step in range(3):
        tracker.log_metrics({"a": float(step)}, step)
    tracker.flush()  # the store answers: everything is in it on return, nothing in the spool
    client = MlflowClient(f"http://127.0.0.1:{proxy.upstream}")  # the server itself, not through the proxy
    assert sorted(int(m.step) for m in client.get_metric_history(tracker.run_id, "a")) == [0, 1, 2]
    assert not tracker.spool.pending

    caplog.set_level(logging.WARNING, logger=TRACKER_LOGGER)
    monkeypatch.setattr(run_writer, "FLUSH_WAIT_S", WAIT_S, raising=False)
    proxy.hang()
    tracker.log_metrics({"a": 3.0}, 3)  # a flush is due at each step: the writer takes step 3 to the store
    assert proxy.held.wait(30), "the writer's request never reached the store"
    tracker.log_metrics({"a": 4.0}, 4)
    flushing = threading.Thread(target=tracker.flush, daemon=True)  # the runner's, before the checkpoint of step 4
    t0 = time.monotonic()
    flushing.start()
    flushing.join(WAIT_S + 10)
    waited = time.monotonic() - t0
    returned = not flushing.is_alive()
    pending = tracker.spool.pending
    proxy.back()  # the store answers again (and a flush still waiting on it, the old code's, returns)
    flushing.join(120)
    assert returned, f"the flush before a checkpoint waited {waited:.0f} s and more on a store that does not answer"
    assert waited < WAIT_S + 10
    assert pending, "the flush returned but the metrics are neither in the store nor in the spool"
    warnings = [r.getMessage() for r in caplog.records if r.name == TRACKER_LOGGER and r.levelno >= logging.WARNING]
    assert any(f"MLflow store {cfg.uri} has not taken the metrics of run {tracker.run_id}" in w
               and str(tracker.spool.path) in w for w in warnings), warnings

    for step in (5, 6):
        tracker.log_metrics({"a": float(step)}, step)
    tracker.finish()  # the spool replayed: the store is back
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert sorted(int(m.step) for m in client.get_metric_history(tracker.run_id, "a")) == list(range(7))
    twice = [k for k, n in Counter(delivered).items() if n > 1]
    assert not twice, f"written twice: {twice}"
    assert not tracker.spool.path.exists()


def test_relax_bounds_mlflow_http_retries_unless_the_user_set_them(policy_env: None, monkeypatch: pytest.MonkeyPatch,
                                                                   closed_port: Callable[[], int]) -> None:
    """Relax's HTTP policy is set where the user set nothing, and MLflow reads it: a request to a port where nothing
    listens fails within seconds (MLflow's default, 7 retries with backoff up to 120 s: minutes). A value the user
    set is kept; a sqlite store gets none."""
    from mlflow.exceptions import MlflowException

    from relax.tracking.mlflow_run import HTTP_POLICY, bound_http_retries

    assert set(HTTP_POLICY) == set(HTTP_VARS)
    assert bound_http_retries("sqlite:///mlflow.db") == {}
    assert not any(os.environ.get(name) for name in HTTP_VARS)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")  # the user's
    set_here = bound_http_retries("http://127.0.0.1:1")
    assert set_here == {k: v for k, v in HTTP_POLICY.items() if k != "MLFLOW_HTTP_REQUEST_TIMEOUT"}
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"
    assert all(os.environ[k] == v for k, v in set_here.items())
    t0 = time.monotonic()
    with pytest.raises(MlflowException):
        MlflowClient(f"http://127.0.0.1:{closed_port()}").get_run("0" * 32)
    assert time.monotonic() - t0 < 15
