"""The write path of one MLflow run (see `relax.tracking.mlflow_run` for the contract): metrics buffered and written
in batches, by a writer thread or in the caller; every write the store cannot take kept in the run's spool file
and replayed, in order and never twice, once the store is back. `Tracker` owns the run's lifecycle (start,
reopen, finish) and what is logged; it writes everything through one `RunWriter`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from relax.tracking.spool_file import ReplayResult, Spool, is_rejection, is_store_error, short_error

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger("relax.tracking.mlflow_run")  # one logger for the run's tracking messages

MAX_METRICS_PER_BATCH = 1000  # MLflow's per-call limit (mlflow.utils.validation; a test checks they agree)
_MAX_BUFFERED_METRICS = 100_000  # bound on memory if the store keeps failing with a non-store error
_WRITE_ATTEMPTS = 3  # writes that cannot be spooled (reopen's status update); spooled writes are retried by replay
# How long the end of a run (Tracker.finish) waits for each of: the system metrics' last sample, the writer thread's
# write in progress, and the final writes (metrics, tags, run status; plus final_replay_s to replay a spool). A store
# that hangs longer gets nothing more: the rest goes to the spool, and the printed command replays it
CLOSE_JOIN_S = 120.0
# How long a durability flush (`RunWriter.flush`, before each checkpoint) waits for the writer thread to put what was
# logged into the store. A store that has not taken it by then (down, hung, inside MLflow's own HTTP retries) does
# not hold training: the metrics go to the spool on disk (fsync'ed) and the writer thread writes them when it answers
FLUSH_WAIT_S = 5.0

T = TypeVar("T")


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


class RunWriter:
    """Everything written to one MLflow run goes through here: `buffer` (metrics, under `lock`), `flush`, `drain`,
    `store_write` (params, tags, artifacts, inputs, the final status), the spool and its `replay`.

    With `background` a daemon thread drains the buffer when woken (`wake`) or every `flush_interval_s`; without
    it, the caller drains (deterministic, for tests). `stats` counts batches, metrics and seconds spent writing,
    store errors, records spooled and replayed.
    """

    def __init__(self, client: MlflowClient, run_id: str, uri: str, spool: Spool, *, flush_every_steps: int,
                 flush_interval_s: float, background: bool, stats: dict[str, Any]) -> None:
        self.client, self.run_id, self.uri, self.spool = client, run_id, uri, spool
        self.flush_every_steps = flush_every_steps
        self.flush_interval_s = flush_interval_s
        self.stats = stats
        self.buffer: list[tuple[str, float, int, int]] = []  # (key, value, timestamp ms, step)
        self.lock = threading.RLock()  # guards the buffer; held only for list operations
        self._write_lock = threading.Lock()  # one writer at a time; taken before `lock`, never inside it
        self._in_flight = False  # the writer holds metrics taken from the buffer, not yet in the store or spool
        self._writing: list[tuple[str, float, int, int]] = []  # those metrics
        self._last_step: Optional[int] = None
        self._steps_since_flush = 0
        self._last_flush = time.monotonic()
        self._flush_failures = 0
        self._outage_warned = False
        self._slow_warned = False
        self._handed_off = False  # a flush put the write in progress into the spool: its outcome adds nothing there
        self._failed = False  # the writer thread's last drain raised an error that is not the store's
        self._written = threading.Condition(self.lock)  # notified when a write of the writer thread ends
        self._rejection_warned = False
        self._wake = threading.Event()
        self._stop = False
        self._abandoned = False  # the run ended without waiting for a hung write (`abandon`)
        self.thread: Optional[threading.Thread] = None
        if background:
            self.thread = threading.Thread(target=self._loop, name="relax-mlflow-writer", daemon=True)
            self.thread.start()

    def step_logged(self, step: int, training_step: bool) -> tuple[bool, bool]:
        """After metrics of `step` were buffered (call with `lock` held): (a flush is due, the spool holds records)."""
        if training_step and step != self._last_step:
            self._last_step = step
            self._steps_since_flush += 1
        spooling = self.spool.pending > 0
        due = (
            spooling  # an outage: each step goes to disk now, and the spool is replayed
            or self._steps_since_flush >= self.flush_every_steps
            or time.monotonic() - self._last_flush >= self.flush_interval_s
            or len(self.buffer) >= 10 * MAX_METRICS_PER_BATCH
        )
        return due, spooling

    def flush_due(self, spooling: bool) -> None:
        """A due flush: to the spool at once during an outage; then by the writer thread, or here."""
        try:
            if spooling:
                self.spool_buffer()
            if self.thread is not None:
                self._wake.set()
                return
            self.drain()
        except Exception as exc:  # never let the store stop training; retried at the next flush
            self.flush_failed(exc)

    def flush_failed(self, exc: Exception) -> None:
        self._flush_failures += 1
        logger.warning("MLflow flush failed (%d so far), will retry: %s", self._flush_failures, exc)

    def flush(self, wait_s: Optional[float] = None) -> None:
        """Everything buffered into the store, or into the spool on disk: durable on return.

        With the writer thread the caller never talks to the store itself: it wakes the writer and waits up to
        `wait_s` (FLUSH_WAIT_S) for it to have written everything logged. During an outage (the spool holds records),
        or when the store has not taken them in that time, the buffer and the write in progress go to the spool
        (fsync'ed; the write in progress as uncertain, which the replay compares with the store first) and the writer
        replays them once the store answers. Without the thread, the caller drains (deterministic, for tests)."""
        if self.thread is None or not self.thread.is_alive():
            self.drain()
            return
        wait_s = FLUSH_WAIT_S if wait_s is None else wait_s
        failed = False
        with self._written:
            if not self.spool.pending:
                self._wake.set()
                written = self._written.wait_for(
                    lambda: self.spool.pending or self._failed or (not self.buffer and not self._in_flight),
                    timeout=wait_s)
                if written and self._failed and not self.spool.pending:
                    failed = True  # not the store's error (it would be spooled): the caller's drain raises it
                elif written and not self.spool.pending:
                    return
                if not written and not self._slow_warned:
                    self._slow_warned = True
                    logger.warning(
                        "MLflow store %s has not taken the metrics of run %s within %g s (a write is still in "
                        "progress: the store is down, slow, or inside MLflow's HTTP retries); training goes on: they "
                        "are kept in %s and written when the store answers (this warning is not repeated)", self.uri,
                        self.run_id, wait_s, self.spool.path)
            if not failed:
                self.spool_buffer()  # durable now; the writer replays without holding up the caller
                if self._in_flight and not self._handed_off:
                    self.spool_in_flight()
                    self._handed_off = True
        if failed:
            self.drain()
            return
        self._wake.set()

    def stop(self, timeout_s: Optional[float] = None) -> bool:
        """End the writer thread (after its current write); later writes happen in the caller. False: the thread is
        still inside a store write after `timeout_s` (the store hangs); it is left behind (a daemon thread)."""
        if self.thread is not None:
            self._stop = True
            self._wake.set()
            self.thread.join(timeout_s)
            return not self.thread.is_alive()
        return True

    @property
    def abandoned(self) -> bool:
        """The run's end stopped waiting for a write that hangs (`abandon`)."""
        return self._abandoned

    def abandon(self) -> None:
        """The end of the run no longer waits for a hung write, and puts what it holds in the spool
        (`spool_in_flight`): a write that returns after this writes nothing more, to the store or the spool (its
        metrics would be there twice)."""
        with self.lock:
            self._abandoned = True

    def spool_in_flight(self) -> None:
        """The metrics of a write that has not come back (a hung store), into the spool as uncertain: the replay
        compares them with the store first, so none is written twice if the hung write lands after all."""
        with self.lock:
            if self._writing:
                self.spool.append("metrics", {"metrics": [list(m) for m in self._writing]}, uncertain=True)
                self.stats["spooled_records"] += 1

    def spool_buffer(self) -> None:
        """Move the buffered metrics to the spool (fsync'ed); on failure they stay buffered."""
        with self.lock:
            if not self.buffer:
                return
            self.spool.append("metrics", {"metrics": [list(m) for m in self.buffer]})
            self.stats["spooled_records"] += 1
            self.buffer = []
            self._steps_since_flush = 0
            self._last_flush = time.monotonic()

    def drain(self) -> None:
        """Write the buffer in chunks of MLflow's batch limit, or to the spool during an outage.

        A store error moves the unwritten rest (and whatever was logged meanwhile) to the spool; any other
        error puts it back in front of the buffer and is raised.
        """
        from mlflow.entities import Metric

        with self._write_lock:
            if self.spool.pending:
                self.spool_buffer()
                self.replay()
                return
            with self.lock:
                self._failed = False
                pending, self.buffer = self.buffer, []
                self._steps_since_flush = 0
                self._last_flush = time.monotonic()
                self._in_flight = bool(pending)
                self._writing = pending
            done = 0
            try:
                for chunk in chunks(pending, MAX_METRICS_PER_BATCH):
                    if self._abandoned or self._handed_off:  # a hung call came back after the run ended, or after
                        return  # a flush stopped waiting for it: the spool has the rest
                    t = time.perf_counter()
                    metrics = [Metric(key=k, value=v, timestamp=ts, step=s) for k, v, ts, s in chunk]
                    self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
                    done += len(chunk)
                    self.stats["batches"] += 1
                    self.stats["metrics"] += len(chunk)
                    self.stats["write_s"] += time.perf_counter() - t
            except Exception as exc:
                rest = pending[done:]
                with self.lock:
                    handed_off = self._abandoned or self._handed_off
                if handed_off:  # in the spool already (`spool_in_flight`)
                    if is_store_error(exc) and not self._abandoned:
                        self.store_failed(exc)
                    return
                if is_store_error(exc):
                    try:
                        with self.lock:
                            if self._handed_off:  # a flush spooled them meanwhile
                                rest = []
                            # the failed chunk may be partly in the store: replay compares it with the store first
                            for part, uncertain in ((rest[:MAX_METRICS_PER_BATCH], True),
                                                    (rest[MAX_METRICS_PER_BATCH:], False)):
                                if part:
                                    self.spool.append("metrics", {"metrics": [list(m) for m in part]},
                                                      uncertain=uncertain)
                                    self.stats["spooled_records"] += 1
                                    rest = rest[len(part):]
                            self.spool_buffer()  # logged meanwhile: after them
                            # in the spool now, no longer in flight: a flush before `finally` must not spool them again
                            self._in_flight, self._writing = False, []
                    except Exception:
                        pass  # the spool failed too (disk): keep them in memory, raise the store's error below
                    else:
                        self.store_failed(exc)
                        if is_rejection(exc):  # the store is up: set the refused record aside, write the rest
                            self.replay()
                        return
                with self.lock:
                    if self._handed_off:  # a flush spooled them meanwhile
                        return
                    self._failed = True
                    self.buffer[:0] = rest
                    self._in_flight, self._writing = False, []  # back in the buffer: a flush spools them from there
                    if len(self.buffer) > _MAX_BUFFERED_METRICS:
                        dropped = len(self.buffer) - _MAX_BUFFERED_METRICS
                        del self.buffer[:dropped]
                        logger.warning("dropped the %d oldest buffered metric values", dropped)
                raise
            finally:
                with self.lock:
                    self._in_flight = False  # written, spooled or back in the buffer
                    self._writing = []
                    self._handed_off = False
                    self._written.notify_all()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if self._stop:
                return
            if self.buffer or self.spool.pending:
                try:
                    self.drain()
                except Exception as exc:
                    self.flush_failed(exc)

    @staticmethod
    def retry(write: Any) -> None:
        """`write()`, tried up to _WRITE_ATTEMPTS times (for writes that cannot be spooled)."""
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                write()
                return
            except Exception:
                if attempt == _WRITE_ATTEMPTS - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))

    # ---------------------------------------------------------------- outages
    def store_failed(self, exc: BaseException) -> None:
        """Count a store error; the first one of the run is the only one that is reported."""
        self.stats["store_errors"] += 1
        if self._outage_warned or is_rejection(exc):
            return
        self._outage_warned = True
        logger.warning(
            "MLflow store %s is unavailable (%s); training goes on: the writes of run %s are kept in %s and replayed "
            "when the store is back (this warning is not repeated)", self.uri, short_error(exc), self.run_id,
            self.spool.path)

    def store_write(self, op: str, payload: dict[str, Any], write: Any) -> None:
        """A write other than metrics: to the store, or to the spool while it holds records or the store fails.

        A refusal of the store (an invalid value) is raised, as any error that is not the store's.
        """
        uncertain = False
        if not self.spool.pending:
            try:
                write()
                return
            except Exception as exc:
                if not is_store_error(exc) or is_rejection(exc):
                    raise
                self.store_failed(exc)
                uncertain = True
        with self.lock:
            if op == "artifact":
                self.spool.append_artifact(payload["path"], payload["artifact_path"])
            else:
                self.spool.append(op, payload, uncertain=uncertain)
            self.stats["spooled_records"] += 1
        self._wake.set()

    def replay(self, *, attempts: Optional[int] = 1, deadline_s: Optional[float] = None) -> ReplayResult:
        """Replay the spool (in order, no value twice); delete it once everything is in the store."""
        result = self.spool.replay(self.client, self.run_id, attempts=attempts, deadline_s=deadline_s)
        self.stats["replayed_records"] += result.records
        if result.error is not None:
            self.stats["store_errors"] += result.attempts
        if result.set_aside and not self._rejection_warned:
            self._rejection_warned = True
            logger.warning("MLflow store %s refused %d spooled write(s) of run %s; they are kept in %s", self.uri,
                           result.set_aside, self.run_id, self.spool.rejected_path)
        if result.done:
            with self.lock:  # no append can come in between
                if self.spool.remove_if_done() and result.records:
                    logger.info("MLflow store %s is back: %d spooled writes of run %s replayed", self.uri,
                                result.records, self.run_id)
        return result
