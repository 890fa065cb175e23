"""The MLflow store unavailable during a run: training goes on, writes are spooled to disk and replayed exactly once.

The store is the real sqlite one. Outages are injected by making the tracker's MlflowClient raise what MLflow
raises for a locked database (or, in one test, by really locking the database with a short busy timeout).
"""

from __future__ import annotations

import atexit
import http.server
import logging
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from relax.config.schema import RelaxConfig, TrackingConfig, TrainConfig
from relax.tracking import RunOptions, Tracker
from relax.tracking import spool as S
from relax.tracking.mlflow_run import TrackingUnavailable

pytestmark = pytest.mark.slow  # starts processes (tests/README.md)

TRACKER_LOGGER = "relax.tracking.mlflow_run"


# ---------------------------------------------------------------------------- the store and its faults
@pytest.fixture
def store(fresh_store, tmp_path: Path) -> Path:
    """A fresh sqlite store file in tmp_path (tests/conftest.py)."""
    return fresh_store(tmp_path)


@pytest.fixture
def cfg(store: Path, request: pytest.FixtureRequest) -> TrackingConfig:
    return TrackingConfig(uri=f"sqlite:///{store}", experiment=request.node.name[:60])


def locked_error() -> Exception:
    """What MLflow's SQL store raises when sqlite stays locked past its busy timeout."""
    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    cause = sqlalchemy.exc.OperationalError("INSERT INTO metrics ...", {},
                                            sqlite3.OperationalError("database is locked"))
    return MlflowException(message=str(cause), error_code=TEMPORARILY_UNAVAILABLE)


class FlakyStore:
    """Wraps the store calls of an MlflowClient (an instance, or the class for clients made elsewhere).

    While `down`, every call (reads too) raises `locked_error()`; `commit_then_fail` > 0 lets the next log_batch calls
    reach the store and then raise (a timeout after the commit). `delivered` lists every metric the store
    received, as (key, step, timestamp), so that a value written twice shows even though sqlite would
    silently drop the exact duplicate.
    """

    def __init__(self, target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.down = False
        self.commit_then_fail = 0
        self.fail_next = 0  # the next N calls fail, then the store is up
        self.failures = 0
        self.delivered: list[tuple[str, int, int]] = []
        for name in ("log_batch", "log_text", "log_artifact", "set_terminated", "get_metric_history"):
            monkeypatch.setattr(target, name, self._wrap(getattr(target, name), name, target))

    def _wrap(self, real: Any, name: str, target: Any) -> Any:
        unbound = isinstance(target, type)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.fail_next > 0:
                self.fail_next -= 1
                self.failures += 1
                raise locked_error()
            if self.down:
                self.failures += 1
                raise locked_error()
            out = real(*args, **kwargs)
            if name == "log_batch":
                metrics = kwargs.get("metrics") or (args[2 if unbound else 1] if len(args) > (2 if unbound else 1)
                                                    else [])
                self.delivered.extend((m.key, int(m.step), int(m.timestamp)) for m in metrics)
                if metrics and self.commit_then_fail > 0:
                    self.commit_then_fail -= 1
                    self.failures += 1
                    raise TimeoutError("read timed out (after the server committed)")
            return out

        return call

    def assert_nothing_twice(self) -> None:
        twice = [k for k, n in Counter(self.delivered).items() if n > 1]
        assert not twice, f"written twice: {twice[:5]}"


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float, int]]:
    return sorted((int(m.step), m.value, int(m.timestamp)) for m in client.get_metric_history(run_id, key))


def outage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == TRACKER_LOGGER and r.levelno >= logging.WARNING]


def start(cfg: TrackingConfig, spool_dir: Path, **options: Any) -> Tracker:
    """`Tracker.start` of run "outage" with one tag and one param; `options`: `RunOptions` fields."""
    options.setdefault("background", False)
    options.setdefault("flush_every_steps", 5)
    options.setdefault("final_replay_s", 0.3)
    return Tracker.start(cfg, RunOptions(announce=False, spool_dir=spool_dir, **options), run_name="outage",
                         tags={"t": "1"}, params={"p": "1"})


# ---------------------------------------------------------------------------- mid-run outage
@pytest.mark.parametrize("background", [False, True], ids=["sync", "writer-thread"])
def test_store_down_mid_run_training_goes_on_and_every_value_lands_once(
        cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        background: bool) -> None:
    caplog.set_level(logging.WARNING, logger=TRACKER_LOGGER)
    spool_dir = tmp_path / "ckpt"
    tracker = start(cfg, spool_dir, background=background, flush_interval_s=0.01 if background else 1e9)
    flaky = FlakyStore(tracker.client, monkeypatch)
    spool_file = S.spool_path(spool_dir, tracker.run_id)
    windows: dict[int, tuple[int, int]] = {}
    for step in range(30):
        flaky.down = 7 <= step < 19 or 22 <= step < 26  # two outages
        before = int(time.time() * 1000)
        tracker.log_metrics({"a": float(step), "b": 2.0 * step}, step)  # never raises
        windows[step] = (before, int(time.time() * 1000))
        if step == 12:
            tracker.log_text("late: true\n", "late.yaml")  # an artifact during the outage
            tracker.set_tags({"during": "outage"})
            tracker.flush()  # a checkpoint: durable although the store is down
            assert spool_file.exists()
            spooled = [m for r in S.Spool(spool_file)._read_pending()[0] for m in r.get("metrics", ())]
            assert {m[3] for m in spooled} >= set(range(7, 13))  # logged while the store was down
        if background:
            time.sleep(0.02)  # a training step: the writer gets to run
    if background:
        deadline = time.monotonic() + 10
        while tracker.spool.pending and time.monotonic() < deadline:
            time.sleep(0.02)
    else:
        assert not spool_file.exists()  # replayed at step 19 and deleted, before the run ended
    tracker.finish()
    assert not spool_file.exists()

    assert flaky.failures >= 1 and tracker.stats["store_errors"] >= 1
    (warning,) = outage_warnings(caplog)  # exactly one, however many failures and outages
    assert cfg.uri in warning and str(spool_file) in warning
    client = MlflowClient(cfg.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["during"] == "outage" and run.data.params == {"p": "1"}
    assert {a.path for a in client.list_artifacts(tracker.run_id)} == {"late.yaml"}
    for key, scale in (("a", 1.0), ("b", 2.0)):
        rows = history(client, tracker.run_id, key)
        assert [(s, v) for s, v, _ in rows] == [(s, scale * s) for s in range(30)]  # every step, once
        for s, _, ts in rows:  # the time it was logged, not the time it was replayed
            assert windows[s][0] <= ts <= windows[s][1]
    flaky.assert_nothing_twice()


def test_a_write_that_committed_before_failing_is_not_written_again(
        cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout after the server committed: the spooled batch is 'uncertain' and compared with the store."""
    tracker = start(cfg, tmp_path, flush_every_steps=4)
    flaky = FlakyStore(tracker.client, monkeypatch)
    keys = [f"k{i:03d}" for i in range(300)]  # 4 steps = 1200 values: two log_batch calls per flush
    for step in range(12):
        if step == 3:
            flaky.commit_then_fail = 1  # the first chunk of the flush at step 3 lands, then the call fails
        if step == 4:
            flaky.fail_next = 1  # and the replay at step 4 fails once more
        tracker.log_metrics({k: step + i / 1000 for i, k in enumerate(keys)}, step)
    tracker.finish()
    client = MlflowClient(cfg.uri)
    for key in (keys[0], keys[150], keys[-1]):
        assert [s for s, _, _ in history(client, tracker.run_id, key)] == list(range(12))
    assert len(flaky.delivered) == 12 * len(keys)
    flaky.assert_nothing_twice()
    assert not tracker.spool.path.exists()


def test_a_flush_right_after_the_writer_spooled_its_failed_write_spools_nothing_twice(
        cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer thread's write fails; it spools the batch (uncertain) and, before it marks the write finished, a
    checkpoint's flush comes in (made to happen there: from the hook that reports the outage). The flush must not
    spool the batch a second time: two uncertain copies in one replay group were both written (seen once in CI,
    under load). Negative control: without the writer's `_in_flight, _writing = False, []` after spooling and the
    replay's dedup within a group, `assert_nothing_twice` names the batch's values."""
    tracker = start(cfg, tmp_path, background=True, flush_interval_s=1e9)
    flaky = FlakyStore(tracker.client, monkeypatch)
    writer = tracker.writer
    real_store_failed = writer.store_failed
    flushed: list[bool] = []

    def store_failed_then_a_flush(exc: BaseException) -> None:
        real_store_failed(exc)
        if not flushed:
            flushed.append(True)
            writer.flush()  # the checkpoint's flush, between the writer's spooling and the end of its write

    monkeypatch.setattr(writer, "store_failed", store_failed_then_a_flush)
    flaky.fail_next = 1
    tracker.log_metrics({"a": 1.0, "b": 2.0}, 0)
    writer.flush()  # wakes the writer: its write fails, is spooled, then the hook's flush runs
    assert flushed == [True]
    tracker.log_metrics({"a": 3.0, "b": 4.0}, 1)
    tracker.finish()
    client = MlflowClient(cfg.uri)
    for key in ("a", "b"):
        assert [s for s, _, _ in history(client, tracker.run_id, key)] == [0, 1]
    flaky.assert_nothing_twice()


def test_a_really_locked_sqlite_store(cfg: TrackingConfig, store: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Another connection holds an exclusive transaction: MLflow's own "database is locked" error path."""
    import mlflow.store.db.utils as db_utils
    import sqlalchemy

    class ShortBusyTimeout:  # MLflow waits 20 s on a locked sqlite; 0.1 s keeps the test short
        def __getattr__(self, name: str) -> Any:
            return getattr(sqlalchemy.sql, name)

        @staticmethod
        def text(sql: str) -> Any:
            return sqlalchemy.sql.text(sql.replace("busy_timeout = 20000", "busy_timeout = 100"))

    monkeypatch.setattr(db_utils, "sql", ShortBusyTimeout())
    caplog.set_level(logging.WARNING, logger=TRACKER_LOGGER)
    tracker = start(cfg, tmp_path, flush_every_steps=2)
    lock = sqlite3.connect(store, isolation_level=None)
    try:
        for step in range(10):
            if step == 2:
                lock.execute("BEGIN EXCLUSIVE")
            if step == 7:
                lock.execute("COMMIT")
            tracker.log_metrics({"x": float(step)}, step)
            if 3 <= step < 7:
                assert tracker.spool.pending  # the steps of the outage are on disk
    finally:
        if lock.in_transaction:
            lock.execute("COMMIT")
        lock.close()
    tracker.finish()
    assert len(outage_warnings(caplog)) == 1 and "database is locked" in outage_warnings(caplog)[0]
    assert tracker.stats["store_errors"] >= 3
    client = MlflowClient(cfg.uri)
    assert [s for s, _, _ in history(client, tracker.run_id, "x")] == list(range(10))
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


# ---------------------------------------------------------------------------- down until the end
def test_store_down_to_the_end_then_the_replay_command_loads_everything_once(
        cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=TRACKER_LOGGER)
    keys = [f"m{i:03d}" for i in range(120)]
    tracker = start(cfg, tmp_path, flush_every_steps=1)
    flaky = FlakyStore(tracker.client, monkeypatch)
    for step in range(25):
        flaky.down = step >= 3
        tracker.log_metrics({k: step + i / 1000 for i, k in enumerate(keys)}, step)
    tracker.finish()  # returns: the run ends although its last writes could not be made
    assert len(outage_warnings(caplog)) == 1
    err = capsys.readouterr().err
    path = tracker.spool.path
    assert f"{S.REPLAY_COMMAND} {path}" in err and "still unavailable" in err and "run status FINISHED" in err
    client = MlflowClient(cfg.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "RUNNING"  # the status is in the spool too
    assert [s for s, _, _ in history(client, tracker.run_id, "m000")] == [0, 1, 2]
    spool = S.Spool(path)
    assert spool.pending == 22 + 1 and spool.describe() == "23 records: metrics of steps 3-24, run status FINISHED"
    (end_time,) = [r["end_time"] for r in spool._read_pending()[0] if r["op"] == "terminate"]

    # the store is back; the replay is cut off twice: by a store error, then by a kill between a write and its ack
    counting = FlakyStore(MlflowClient, monkeypatch)
    counting.delivered = list(flaky.delivered)
    real_log_batch = MlflowClient.log_batch
    calls = {"n": 0}

    def fails_after_one(self: MlflowClient, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > 1:
            raise locked_error()
        return real_log_batch(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(MlflowClient, "log_batch", fails_after_one)
        assert S.main([str(path), "--attempts", "2", "--backoff", "0.01"]) == 1
    assert 0 < S.Spool(path).pending < 23
    with monkeypatch.context() as m:
        real_ack = S.Spool.ack

        def killed(self: S.Spool, seq: int, next_pos: int) -> None:
            raise KeyboardInterrupt  # the write went through, its ack never did

        m.setattr(S.Spool, "ack", killed)
        with pytest.raises(KeyboardInterrupt):
            S.main([str(path)])
        m.setattr(S.Spool, "ack", real_ack)
    assert S.main([str(path)]) == 0
    assert not path.exists()
    assert "spool removed" in capsys.readouterr().out
    again = subprocess.run([sys.executable, "-m", "relax.tracking.spool", str(path)], capture_output=True, text=True)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again  # the command, run twice
    assert "RuntimeWarning" not in again.stderr

    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.end_time == end_time  # when the run ended, not the replay
    for key in (keys[0], keys[-1]):
        rows = history(client, tracker.run_id, key)
        assert [s for s, _, _ in rows] == list(range(25))
    counting.assert_nothing_twice()
    assert len(counting.delivered) == 25 * len(keys)


def test_a_resumed_job_replays_the_spool_of_the_killed_one_first(
        cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tracker = start(cfg, tmp_path, flush_every_steps=1)
    flaky = FlakyStore(tracker.client, monkeypatch)
    for step in range(6):
        flaky.down = step >= 3
        tracker.log_metrics({"a": float(step), "b": float(step)}, step)
    assert tracker.spool.pending == 3  # steps 3-5; a checkpoint at step 5 was committed (they are durable)
    atexit.unregister(tracker._at_exit)  # kill -9: nothing more happens in that process
    tracker.spool.close()

    resumed = Tracker.reopen(cfg, tracker.run_id, RunOptions(spool_dir=tmp_path, announce=False, background=False),
                             from_step=4)
    with resumed:
        for step in range(4, 8):
            resumed.log_metrics({"a": step + 0.5, "b": step + 0.5}, step)
    assert resumed.stats["already_recorded"] == 4  # steps 4 and 5 came from the spool
    client = MlflowClient(cfg.uri)
    for key in ("a", "b"):
        assert [(s, v) for s, v, _ in history(client, tracker.run_id, key)] == \
            [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.5), (7, 7.5)]
    assert not S.spool_path(tmp_path, tracker.run_id).exists()


def test_a_new_run_replays_spools_left_in_its_directory(cfg: TrackingConfig, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    first = start(cfg, tmp_path, flush_every_steps=1)
    flaky = FlakyStore(first.client, monkeypatch)
    flaky.down = True
    first.log_metrics({"a": 1.0}, 0)
    first.finish()
    assert first.spool.path.exists()
    with start(cfg, tmp_path):  # the store is back (a new client): the next run in the directory replays it
        pass
    assert not first.spool.path.exists()
    client = MlflowClient(cfg.uri)
    assert client.get_run(first.run_id).info.status == "FINISHED"
    assert [s for s, _, _ in history(client, first.run_id, "a")] == [0]


# ---------------------------------------------------------------------------- spool file details
def test_a_torn_last_line_is_skipped_and_later_appends_stay_whole(tmp_path: Path) -> None:
    path = S.spool_path(tmp_path, "r1")
    spool = S.Spool(path, run_id="r1", uri="sqlite:///x.db")
    spool.append("metrics", {"metrics": [["a", 1.0, 10, 0]]})
    spool.close()
    with open(path, "ab") as fh:
        fh.write(b'{"seq": 2, "op": "metr')  # the crash
    spool = S.Spool(path)
    assert (spool.run_id, spool.uri, spool.pending) == ("r1", "sqlite:///x.db", 1)
    spool.append("tags", {"items": [["k", "v"]]})
    records, _ = spool._read_pending()
    assert [r["seq"] for r in records] == [1, 2] and spool.torn_lines == 1


# ---------------------------------------------------------------------------- store down at the start
@pytest.fixture
def unreachable_server(monkeypatch: pytest.MonkeyPatch, closed_port: Callable[[], int]) -> Iterator[str]:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    yield f"http://127.0.0.1:{closed_port()}"


class _HungStore(http.server.BaseHTTPRequestHandler):
    """Answers its root (so the `endpoints` check before Ray lets it through), then never answers MLflow's API: a
    store whose backend hangs."""

    release = threading.Event()

    def do_GET(self):  # noqa: N802 - the stdlib's name
        if self.path != "/":
            self.release.wait()
            return
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def silent_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A store that answers the `endpoints` check and never answers the run's requests."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    _HungStore.release.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HungStore)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        _HungStore.release.set()
        server.shutdown()
        server.server_close()


def test_store_down_at_the_start_fails_before_training_naming_the_uri(unreachable_server: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(TrackingUnavailable, match=f"MLflow store {unreachable_server} is unavailable when the run "
                                                  "starts.*nothing was trained.*Check tracking.uri"):
        Tracker.start(TrackingConfig(uri=unreachable_server), RunOptions(announce=False))
    assert time.perf_counter() - t0 < 10


def test_session_turns_it_into_one_message(unreachable_server: str, tmp_path: Path) -> None:
    from relax.runner.errors import RunError
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    relax_cfg = RelaxConfig(tracking=TrackingConfig(uri=unreachable_server, progress=False))
    with pytest.raises(RunError, match=f"MLflow store {unreachable_server} is unavailable"):
        with Session(relax_cfg, build_plan(relax_cfg), tmp_path / "out"):
            pass


@pytest.mark.slow
def test_a_run_whose_store_is_down_stops_the_roles_it_launched(silent_server: str, ray_local: Any,
                                                                small_run: Any, tmp_path: Path) -> None:
    """The roles start while the driver opens its MLflow run (relax.runner.train.Recipe.setup): when the run cannot be
    opened, the error is the store's, and no role process is left holding Ray's CPUs. (A store where nothing listens
    is refused before Ray, and so is one that accepts connections and answers nothing: tests/runner/
    test_preflight_endpoints.py; this one answers the check, then never answers the run.)"""
    from relax.config import load_config
    from relax.runner.errors import RunError
    from relax.runner.train import run

    cfg = load_config(small_run(f"tracking.uri={silent_server}", steps=1))
    # the CPUs free before the run, not all of the worker's shared Ray: an actor an earlier test left (one that
    # failed before its cleanup) is not this run's
    free_before = ray_local.available_resources().get("CPU", 0.0)
    with pytest.raises(RunError, match=f"MLflow store {silent_server} is unavailable"):
        run(cfg, output_dir=tmp_path / "out")
    # ray.kill is asynchronous: a killed role gives its CPUs back once its process is gone, which on a loaded
    # machine can take a while; roles left running would keep them
    deadline = time.monotonic() + 90
    while ray_local.available_resources().get("CPU", 0.0) < free_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_local.available_resources().get("CPU", 0.0) >= free_before


# ---------------------------------------------------------------------------- through the runner's Session
class FakeCluster:
    def __init__(self) -> None:
        self.saved: list[int] = []

    def save(self, checkpoints: Any, step: int, state: dict, rollout: Any = None) -> Path:
        self.saved.append(step)
        return Path(checkpoints.save_dir) / f"step_{step:06d}"


def test_session_keeps_checkpointing_during_an_outage_and_spools_next_to_the_checkpoints(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from relax.runner.checkpoint import Checkpoints
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    caplog.set_level(logging.WARNING, logger=TRACKER_LOGGER)
    monkeypatch.setenv("RELAX_MLFLOW_FLUSH_S", "0.01")
    relax_cfg = RelaxConfig(tracking=TrackingConfig(uri=f"sqlite:///{store}", progress=False),
                            train=TrainConfig(num_rollout=12, save_dir=str(tmp_path / "ckpt")))
    cluster = FakeCluster()
    with Checkpoints(relax_cfg) as checkpoints, \
            Session(relax_cfg, build_plan(relax_cfg), tmp_path / "out", checkpoints=checkpoints) as session:
        flaky = FlakyStore(session.tracker.client, monkeypatch)
        assert session.spool_dir() == checkpoints.save_dir
        for step in range(12):
            flaky.down = 3 <= step < 9
            session.log({"rollout/raw_reward": step / 10, "perf/step_time": 0.1}, step)
            time.sleep(0.01)
            if step % 3 == 2:  # every checkpoint is committed, the outage's too
                assert session.save_checkpoint(cluster, step + 1, {"step": step + 1}) is not None
            if step == 5:
                assert S.spool_path(checkpoints.save_dir, session.tracker.run_id).exists()
        result = session.finish()
    assert cluster.saved == [3, 6, 9, 12]
    assert len(outage_warnings(caplog)) == 1
    client = MlflowClient(f"sqlite:///{store}")
    for key in ("rollout/raw_reward", "perf/step_time"):
        assert Counter(s for s, _, _ in history(client, result.run_id, key)) == Counter(range(12))
    assert client.get_run(result.run_id).info.status == "FINISHED"
    assert not list(checkpoints.save_dir.glob("mlflow-spool-*"))
    flaky.assert_nothing_twice()


# ---------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_a_training_run_survives_a_store_outage(in_process: None, small_run: Any, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    from relax.config import load_config
    from relax.runner.train import run

    caplog.set_level(logging.WARNING, logger=TRACKER_LOGGER)
    monkeypatch.setenv("RELAX_MLFLOW_FLUSH_S", "0.05")  # the writer writes at every step
    flaky = FlakyStore(MlflowClient, monkeypatch)
    real_log_batch = MlflowClient.log_batch
    state = {"failed": 0}

    def down_after_the_first_step(self: MlflowClient, run_id: str, metrics: Any = (), **kwargs: Any) -> Any:
        if any(m.step >= 1 for m in metrics) and state["failed"] < 3:  # three writes fail, then it is back
            state["failed"] += 1
            raise locked_error()
        return real_log_batch(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", down_after_the_first_step)
    cfg = load_config(small_run("train.save_interval=2", steps=4))
    t0 = time.perf_counter()
    result = run(cfg, output_dir=tmp_path / "out")
    took = time.perf_counter() - t0
    assert state["failed"] == 3
    assert len(outage_warnings(caplog)) == 1
    client = MlflowClient(cfg.tracking.uri)
    mlrun = client.get_run(result.run_id)
    assert mlrun.info.status == "FINISHED"
    for key in result.history[0][1]:
        logged = [s for s, m in result.history if key in m and m[key] == m[key]]  # finite values are logged
        assert Counter(s for s, _, _ in history(client, result.run_id, key)) == Counter(logged), key
    assert not list((tmp_path / "ckpt").glob("mlflow-spool-*"))
    flaky.assert_nothing_twice()
    print(f"run with a store outage: {took:.1f} s")


def test_a_store_that_hangs_at_the_end_of_a_run_does_not_hold_it_and_loses_nothing(
        cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The store stops answering (a write that never returns) while the writer thread writes: `finish` waits
    CLOSE_JOIN_S for it, not forever, then keeps the metrics it holds, the rest and the final status in the spool
    without calling the store again; replayed once the store answers, the run is complete and FINISHED. Negative
    control: with no bound on the wait (CLOSE_JOIN_S=None), the same hang holds `finish` until the store answers."""
    import threading

    from relax.tracking import mlflow_run

    monkeypatch.setattr(mlflow_run, "CLOSE_JOIN_S", 0.5)
    release = threading.Event()
    hung: list[bool] = []

    def hanging(tracker: Tracker) -> None:
        real = tracker.client.log_batch

        def log_batch(run_id: str, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("metrics") and not release.is_set():
                hung.append(True)
                release.wait()  # a store that does not answer
            return real(run_id, *args, **kwargs)

        monkeypatch.setattr(tracker.client, "log_batch", log_batch)

    def hang_the_writer(tracker: Tracker) -> None:
        """Log step 0: a flush is due at once and the writer thread takes it into the hanging store."""
        tracker.log_metrics({"a": 0.0}, 0)
        deadline = time.monotonic() + 10
        while not hung and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hung, "the writer never reached the store"

    tracker = start(cfg, tmp_path, background=True, flush_interval_s=1e9, flush_every_steps=1)
    hanging(tracker)
    hang_the_writer(tracker)
    for step in (1, 2, 3):
        tracker.log_metrics({"a": float(step)}, step)  # buffered while the writer hangs
    t0 = time.monotonic()
    tracker.finish()
    assert time.monotonic() - t0 < 5  # bounded by CLOSE_JOIN_S, not by the store
    message = capsys.readouterr().err
    assert "did not answer a write" in message and str(tracker.spool.path) in message
    client = MlflowClient(cfg.uri)
    assert client.get_run(tracker.run_id).info.status == "RUNNING"  # the status is in the spool, not the store
    release.set()  # the store answers again (the hung write lands too); replay the spool
    assert S.main([str(tracker.spool.path), "--uri", cfg.uri]) == 0
    assert [s for s, _, _ in history(client, tracker.run_id, "a")] == [0, 1, 2, 3]  # each step once
    assert client.get_run(tracker.run_id).info.status == "FINISHED"

    # negative control: an unbounded wait on the same hang
    monkeypatch.setattr(mlflow_run, "CLOSE_JOIN_S", None)
    release.clear()
    hung.clear()
    other = start(cfg, tmp_path / "other", background=True, flush_interval_s=1e9, flush_every_steps=1)
    hanging(other)
    hang_the_writer(other)
    closing = threading.Thread(target=other.finish, daemon=True)
    closing.start()
    closing.join(2.0)
    assert closing.is_alive(), "finish returned although the store never answered"
    release.set()
    closing.join(10)
    assert not closing.is_alive()
