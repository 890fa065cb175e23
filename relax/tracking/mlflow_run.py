"""One MLflow run per training job, written in batches so that tracking stays off the step's critical path.

Why batches: with the SQL stores every `log_metric` call is its own transaction (a few ms each on
sqlite), so 30 metrics per step logged one by one would cost a noticeable share of a 1 s step.
`Tracker` buffers metrics in memory and writes them with `MlflowClient.log_batch` every
`flush_every_steps` steps or `flush_interval_s` seconds, and at `finish`, chunked to MLflow's
per-call limits. Only `MlflowClient` is used (never the fluent `mlflow.start_run` API), so no
process-global "active run" exists and several trackers can coexist in one process.

Non-finite metric values (NaN, +-inf) are SKIPPED by default (`nonfinite="skip"`): MLflow stores NaN
but plots and cross-run aggregates (relax-compare) are spoiled by it. They are not lost silently: each
key's count is kept in `Tracker.nonfinite_counts`, a warning is logged the first time a key turns
non-finite, and at `finish` the tag `relax.nonfinite_metrics` lists them (e.g. `train/loss=3`).
`nonfinite="log"` writes them as MLflow stores them (NaN as NaN, +-inf clamped to +-max float).

Durability and resume: `flush()` returns once everything logged before it is in the store, so the runner
flushes before it commits a checkpoint (a checkpoint never covers a step whose metrics could still be lost).
A job killed with `kill -9` loses only what was buffered after its last flush; the resumed job recomputes
those steps from the checkpoint and `Tracker.reopen` continues the same run, writing each (key, step) that
the store does not hold yet and skipping those it does, so each step of each key is recorded exactly once.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import shlex
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Protocol, TextIO, TypeVar

from relax.tracking.params import truncate_value

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from relax.config.schema import TrackingConfig

logger = logging.getLogger(__name__)

# MLflow's per-call and per-value limits (mlflow.utils.validation; a test checks they agree).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_TAG_VALUE_LEN = 8000

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
PARENT_RUN_ID_TAG = "mlflow.parentRunId"  # what the MLflow UI nests child runs by
NONFINITE_TAG = "relax.nonfinite_metrics"
TRACKING_URI_TAG = "relax.tracking_uri"
RESUMED_TAG = "relax.resumed"  # a reopened run: at which step and from where it was last continued
NONFINITE_MODES = ("skip", "log")

_MAX_BUFFERED_METRICS = 100_000  # bound on memory if the store stays unreachable
_WRITE_ATTEMPTS = 3  # sqlite may be briefly locked by a sibling job of a multirun

T = TypeVar("T")


class RunTracker(Protocol):
    """What a training loop needs from a tracker; `Tracker` and `NullTracker` both provide it."""

    run_id: Optional[str]
    experiment_id: Optional[str]
    uri: Optional[str]

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_params(self, params: Mapping[str, str]) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None: ...
    def set_tags(self, tags: Mapping[str, str]) -> None: ...
    def flush(self) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...
    def ui_command(self) -> Optional[str]: ...


def quiet_mlflow_logging() -> None:
    """Silence MLflow's INFO chatter (e.g. "Creating initial MLflow database tables...") and alembic's.

    They appear on every new sqlite store and drown the live progress line; warnings still show.
    """
    for name in ("mlflow.store.db.utils", "mlflow.store.tracking.sqlalchemy_store", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def resolve_tracking_uri(uri: str, cwd: Optional[str] = None) -> str:
    """Make a relative sqlite (or plain path / `file:`) store absolute, against `cwd` or the current directory.

    Resolved once at start, so that a later `chdir` (Hydra changes into its run directory) or a Ray
    worker started in another directory writes to the same database. `sqlite:///mlflow.db` is
    relative (three slashes); `sqlite:////abs/mlflow.db` is absolute. Remote URIs are returned as is.
    """
    base = os.getcwd() if cwd is None else cwd
    if uri.startswith("sqlite:"):
        rest = uri[len("sqlite:") :]
        if not rest.startswith("///"):
            return uri  # "sqlite://": in memory
        path, sep, query = rest[3:].partition("?")
        if path in ("", ":memory:"):
            return uri
        path = os.path.expanduser(path)
        if not os.path.isabs(path):
            path = os.path.abspath(os.path.join(base, path))
        return f"sqlite:///{path}{sep}{query}"
    if uri.startswith("file:"):
        path = uri[len("file:") :]
        if path.startswith("//"):
            return uri  # file:///abs or file://host/...
        return "file://" + os.path.abspath(os.path.join(base, os.path.expanduser(path)))
    if "://" not in uri and ":" not in uri.split("/")[0] and not uri.startswith("databricks"):
        return os.path.abspath(os.path.join(base, os.path.expanduser(uri)))  # a plain directory
    return uri


def sqlite_path(uri: str) -> Optional[str]:
    """The database file of an absolute `sqlite:///` URI, else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].partition("?")[0]
    return path if path and path != ":memory:" else None


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _validate_metric_key(key: str) -> None:
    """Fail at the first `log_metrics` of a bad key, not later at a flush that would lose the batch."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"metric key must be a non-empty string, got {key!r}")
    try:
        from mlflow.utils.validation import _validate_metric_name  # private, hence guarded
    except ImportError:  # pragma: no cover - depends on the MLflow version
        return
    try:
        _validate_metric_name(key)
    except Exception as exc:  # MlflowException
        raise ValueError(f"invalid metric key {key!r}: {exc}") from None
    if len(key) > 250:
        raise ValueError(f"metric key longer than MLflow's 250 characters: {key[:60]!r}...")


class Tracker:
    """One MLflow run: params and tags at start, buffered metrics, text and file artifacts, a final status.

    Create with `Tracker.start(...)`. Use as a context manager so that the run ends FAILED on an
    exception and KILLED on Ctrl-C instead of staying RUNNING forever. Thread-safe: metrics may be
    logged from several threads (fully-async training).

    With `background=True` (the default) a daemon thread does the writes, so the training thread only
    appends to a list (microseconds); `background=False` writes inside the `log_metrics` call that makes
    a flush due (deterministic, for tests). `stats` counts batches, metrics and seconds spent writing.
    """

    def __init__(
        self,
        client: MlflowClient,
        run_id: str,
        experiment_id: str,
        uri: str,
        *,
        flush_every_steps: int = 10,
        flush_interval_s: float = 15.0,
        nonfinite: str = "skip",
        background: bool = True,
    ) -> None:
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
        if flush_every_steps < 1:
            raise ValueError(f"flush_every_steps must be >= 1, got {flush_every_steps}")
        self.client = client
        self.run_id: Optional[str] = run_id
        self.experiment_id: Optional[str] = experiment_id
        self.uri: Optional[str] = uri
        self.flush_every_steps = flush_every_steps
        self.flush_interval_s = flush_interval_s
        self.nonfinite = nonfinite
        self.nonfinite_counts: dict[str, int] = {}
        self.status: Optional[str] = None  # set by finish
        self._buffer: list[tuple[str, float, int, int]] = []  # (key, value, timestamp ms, step)
        self._known_keys: set[str] = set()
        self._last_step: Optional[int] = None
        self._steps_since_flush = 0
        self._last_flush = time.monotonic()
        self._lock = threading.RLock()  # guards the buffer; held only for list operations
        self._write_lock = threading.Lock()  # one writer at a time; taken before _lock, never inside it
        self._closing = False
        self._flush_failures = 0
        self._warned_after_finish = False
        self.stats = {"batches": 0, "metrics": 0, "write_s": 0.0, "already_recorded": 0}
        # step -> keys the store already holds at that step (a reopened run's steps being recomputed; see `reopen`)
        self._recorded: dict[int, set[str]] = {}
        self.recorded_history: dict[str, list[tuple[int, float]]] = {}  # reopen(keep_history=...): earlier values
        self._wake = threading.Event()
        self._stop = False
        self._writer: Optional[threading.Thread] = None
        if background:
            self._writer = threading.Thread(target=self._writer_loop, name="relax-mlflow-writer", daemon=True)
            self._writer.start()
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------ start
    @classmethod
    def start(
        cls,
        tracking_cfg: TrackingConfig,
        *,
        run_name: Optional[str] = None,
        tags: Optional[Mapping[str, str]] = None,
        params: Optional[Mapping[str, str]] = None,
        parent_run_id: Optional[str] = None,
        flush_every_steps: int = 10,
        flush_interval_s: float = 15.0,
        nonfinite: str = "skip",
        background: bool = True,
        announce: bool = True,
        stream: Optional[TextIO] = None,
    ) -> Tracker:
        """Open a new run in `tracking_cfg.experiment` (created if missing) at the resolved `tracking_cfg.uri`.

        `run_name` overrides `tracking_cfg.run_name` (both None: MLflow picks a name). `parent_run_id`
        sets `mlflow.parentRunId`, which nests this run under a sweep's parent run in the UI. With
        `announce`, one line naming the run, the store and the UI command is printed to `stream` (stderr).
        """
        quiet_mlflow_logging()
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException
        from mlflow.tracking.context.registry import resolve_tags

        uri = resolve_tracking_uri(tracking_cfg.uri)
        db = sqlite_path(uri)
        if db is not None:
            os.makedirs(os.path.dirname(db) or ".", exist_ok=True)
        with warnings.catch_warnings():  # the store's creation: SQLAlchemy deprecation noise from MLflow's models
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(mlflow|sqlalchemy)\.")
            client = MlflowClient(tracking_uri=uri)
            experiment = client.get_experiment_by_name(tracking_cfg.experiment)
        if experiment is None:
            # Keep artifacts next to the database (MLflow's default is ./mlruns of whatever the cwd is).
            slug = re.sub(r"[^\w.-]+", "_", tracking_cfg.experiment).strip("._") or "experiment"
            artifact_location = os.path.join(os.path.dirname(db), "mlruns", slug) if db else None
            try:
                experiment_id = client.create_experiment(tracking_cfg.experiment, artifact_location=artifact_location)
            except MlflowException:  # created meanwhile by a sibling job
                experiment = client.get_experiment_by_name(tracking_cfg.experiment)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        else:
            if experiment.lifecycle_stage == "deleted":
                raise RuntimeError(
                    f"MLflow experiment {tracking_cfg.experiment!r} (id {experiment.experiment_id}) is deleted in "
                    f"{uri}; restore it (mlflow experiments restore --experiment-id {experiment.experiment_id}) "
                    "or choose another tracking.experiment"
                )
            experiment_id = experiment.experiment_id

        system_tags = {k: str(v) for k, v in resolve_tags({}).items()}  # user, source, git commit
        system_tags[TRACKING_URI_TAG] = uri
        if parent_run_id is not None:
            system_tags[PARENT_RUN_ID_TAG] = parent_run_id
        run = client.create_run(experiment_id, tags=system_tags, run_name=run_name or tracking_cfg.run_name)
        tracker = cls(
            client,
            run.info.run_id,
            experiment_id,
            uri,
            flush_every_steps=flush_every_steps,
            flush_interval_s=flush_interval_s,
            nonfinite=nonfinite,
            background=background,
        )
        try:
            if tags:
                tracker.set_tags(tags)
            if params:
                tracker.log_params(params)
        except BaseException:
            tracker.finish("FAILED")
            raise
        if announce:
            tracker._announce(f"MLflow run {run.info.run_name} ({run.info.run_id}) in experiment "
                              f"{tracking_cfg.experiment!r} at {uri}", stream)
        return tracker

    @classmethod
    def reopen(
        cls,
        tracking_cfg: TrackingConfig,
        run_id: str,
        *,
        from_step: int = 0,
        tags: Optional[Mapping[str, str]] = None,
        keep_history: Sequence[str] = (),
        flush_every_steps: int = 10,
        flush_interval_s: float = 15.0,
        nonfinite: str = "skip",
        background: bool = True,
        announce: bool = True,
        stream: Optional[TextIO] = None,
    ) -> Tracker:
        """Continue the existing run `run_id` (a resumed training job): status back to RUNNING, same metrics.

        Steps from `from_step` on are recomputed by the resumed job, and some of them may already be in
        the store (written by the killed process after its last checkpoint). The steps each key already
        has from `from_step` on are read once here (one query per key), and `log_metrics` does not write
        those (key, step) pairs again, so every step of every key is recorded exactly once; the value kept
        is the first one written. `keep_history` keys get their earlier values in `recorded_history`
        (e.g. the reward, for the end-of-run summary). Params are not logged again (MLflow params are
        immutable). LookupError if the run is not in the store or is deleted.
        """
        quiet_mlflow_logging()
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        uri = resolve_tracking_uri(tracking_cfg.uri)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(mlflow|sqlalchemy)\.")
            client = MlflowClient(tracking_uri=uri)
            try:
                run = client.get_run(run_id)
            except MlflowException as exc:
                raise LookupError(f"MLflow run {run_id} is not in the store {uri}: {exc.message}") from None
        if run.info.lifecycle_stage == "deleted":
            raise LookupError(f"MLflow run {run_id} in {uri} is deleted; restore it (mlflow runs restore --run-id "
                              f"{run_id}) to continue it")
        tracker = cls(
            client,
            run_id,
            run.info.experiment_id,
            uri,
            flush_every_steps=flush_every_steps,
            flush_interval_s=flush_interval_s,
            nonfinite=nonfinite,
            background=background,
        )
        try:
            keep = set(keep_history)
            # the highest step of each key (MLflow's latest metrics): keys that stop before from_step need no query
            last_step = {m.key: m.step for m in getattr(run.data, "_metric_objs", ())}
            for key in run.data.metrics:
                if key not in keep and last_step.get(key, from_step) < from_step:
                    continue
                history = client.get_metric_history(run_id, key)
                for m in history:
                    if m.step >= from_step:
                        tracker._recorded.setdefault(int(m.step), set()).add(key)
                if key in keep:
                    tracker.recorded_history[key] = sorted((int(m.step), m.value) for m in history
                                                           if m.step < from_step)
            tracker._retry(lambda: client.update_run(run_id, status="RUNNING"))
            if tags:
                tracker.set_tags(tags)
        except BaseException:
            tracker.finish("FAILED")
            raise
        if announce:
            tracker._announce(f"MLflow run {run.info.run_name} ({run_id}) reopened at step {from_step} in "
                              f"experiment {tracking_cfg.experiment!r} at {uri}", stream)
        return tracker

    def _announce(self, text: str, stream: Optional[TextIO]) -> None:
        print(f"{text}; view: {self.ui_command()}", file=stream if stream is not None else sys.stderr, flush=True)

    # ---------------------------------------------------------------- logging
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer `metrics` at `step` (cheap); they reach the store at the next flush.

        Values may be anything `float()` accepts (Python/numpy numbers, 1-element tensors). A bad key
        raises ValueError here, at its first use, rather than failing a later batch. In a reopened run,
        (key, step) pairs the store already holds are not written again (see `reopen`).
        """
        ts = int(time.time() * 1000)
        with self._lock:
            if self._closing:
                self._warn_after_finish("log_metrics")
                return
            recorded = self._recorded.get(step) if self._recorded else None
            for key, value in metrics.items():
                if key not in self._known_keys:
                    _validate_metric_key(key)
                    self._known_keys.add(key)
                v = float(value)
                if not math.isfinite(v):
                    if key not in self.nonfinite_counts:
                        logger.warning("metric %s is %s at step %d (%s)", key, v, step, self._nonfinite_action())
                    self.nonfinite_counts[key] = self.nonfinite_counts.get(key, 0) + 1
                    if self.nonfinite == "skip":
                        continue
                if recorded is not None and key in recorded:
                    self.stats["already_recorded"] += 1  # logged before a kill, recomputed after the resume
                    continue
                self._buffer.append((key, v, ts, int(step)))
            if step != self._last_step:
                self._last_step = step
                self._steps_since_flush += 1
            due = (
                self._steps_since_flush >= self.flush_every_steps
                or time.monotonic() - self._last_flush >= self.flush_interval_s
                or len(self._buffer) >= 10 * MAX_METRICS_PER_BATCH
            )
        if not due:
            return
        if self._writer is not None:
            self._wake.set()
            return
        try:
            self._drain()
        except Exception as exc:  # never let the store stop training; retried at the next flush
            self._flush_failed(exc)

    def _nonfinite_action(self) -> str:
        return "skipped; counted in tag " + NONFINITE_TAG if self.nonfinite == "skip" else "logged"

    def _flush_failed(self, exc: Exception) -> None:
        self._flush_failures += 1
        logger.warning("MLflow flush failed (%d so far), will retry: %s", self._flush_failures, exc)

    def flush(self) -> None:
        """Write all buffered metrics now (raises if the store refuses them; they stay buffered)."""
        if not self._closing:
            self._drain()

    def _drain(self) -> None:
        """Write the buffer in chunks of MLflow's batch limit; on failure the unwritten rest goes back in front."""
        from mlflow.entities import Metric

        with self._write_lock:
            with self._lock:
                pending, self._buffer = self._buffer, []
                self._steps_since_flush = 0
                self._last_flush = time.monotonic()
            done = 0
            try:
                for chunk in _chunks(pending, MAX_METRICS_PER_BATCH):
                    t = time.perf_counter()
                    metrics = [Metric(key=k, value=v, timestamp=ts, step=s) for k, v, ts, s in chunk]
                    self._retry(lambda m=metrics: self.client.log_batch(self.run_id, metrics=m, synchronous=True))
                    done += len(chunk)
                    self.stats["batches"] += 1
                    self.stats["metrics"] += len(chunk)
                    self.stats["write_s"] += time.perf_counter() - t
            except Exception:
                with self._lock:
                    self._buffer[:0] = pending[done:]
                    if len(self._buffer) > _MAX_BUFFERED_METRICS:
                        dropped = len(self._buffer) - _MAX_BUFFERED_METRICS
                        del self._buffer[:dropped]
                        logger.warning("dropped the %d oldest buffered metric values", dropped)
                raise

    def _writer_loop(self) -> None:
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if self._stop:
                return
            if self._buffer:
                try:
                    self._drain()
                except Exception as exc:
                    self._flush_failed(exc)

    @staticmethod
    def _retry(write: Any) -> None:
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                write()
                return
            except Exception:
                if attempt == _WRITE_ATTEMPTS - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))

    def log_params(self, params: Mapping[str, str]) -> None:
        """Log params (immutable in MLflow: re-logging a key with another value fails), 100 per call."""
        from mlflow.entities import Param

        from relax.tracking.params import PARAM_VALUE_MAX_LEN

        if self._closed("log_params"):
            return
        self._write_params_tags(
            params=[Param(str(k), truncate_value(str(v), PARAM_VALUE_MAX_LEN)) for k, v in params.items()]
        )

    def _write_params_tags(self, params: Sequence[Any] = (), tags: Sequence[Any] = ()) -> None:
        for chunk in _chunks(list(params), MAX_PARAMS_TAGS_PER_BATCH):
            self._retry(lambda c=chunk: self.client.log_batch(self.run_id, params=list(c), synchronous=True))
        for chunk in _chunks(list(tags), MAX_PARAMS_TAGS_PER_BATCH):
            self._retry(lambda c=chunk: self.client.log_batch(self.run_id, tags=list(c), synchronous=True))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set (or overwrite) run tags, 100 per call; values longer than MLflow's limit are truncated."""
        from mlflow.entities import RunTag

        if self._closed("set_tags"):
            return
        self._write_params_tags(
            tags=[RunTag(str(k), truncate_value(str(v), MAX_TAG_VALUE_LEN)) for k, v in tags.items()]
        )

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store `text` as the artifact `artifact_file` (e.g. "config.yaml", "plan.txt")."""
        if not self._closed("log_text"):
            self.client.log_text(self.run_id, text, artifact_file)

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        """Copy a local file or directory into the run's artifacts (under `artifact_path` if given)."""
        if not self._closed("log_artifact"):
            self.client.log_artifact(self.run_id, path, artifact_path)

    def _closed(self, what: str) -> bool:
        if self._closing:
            self._warn_after_finish(what)
            return True
        return False

    def _warn_after_finish(self, what: str) -> None:
        if not self._warned_after_finish:
            self._warned_after_finish = True
            logger.warning("%s called after the MLflow run %s finished; ignored", what, self.run_id)

    # ----------------------------------------------------------------- ending
    def finish(self, status: str = "FINISHED") -> None:
        """Flush and end the run with `status` (FINISHED, FAILED or KILLED). Later calls do nothing.

        The run is terminated even if the final flush fails; that error is raised afterwards.
        """
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        with self._lock:
            if self._closing:
                return
            self._closing = True  # from here on, logging calls are ignored
        atexit.unregister(self._at_exit)
        if self._writer is not None:
            self._stop = True
            self._wake.set()
            self._writer.join()
        error: Optional[BaseException] = None
        try:
            self._drain()
            if self.nonfinite_counts:
                from mlflow.entities import RunTag

                counts = ", ".join(f"{k}={n}" for k, n in sorted(self.nonfinite_counts.items()))
                self._write_params_tags(tags=[RunTag(NONFINITE_TAG, truncate_value(counts, MAX_TAG_VALUE_LEN))])
        except Exception as exc:
            error = exc
            logger.warning("final MLflow flush of run %s failed: %s", self.run_id, exc)
        self.status = status
        self._retry(lambda: self.client.set_terminated(self.run_id, status=status))
        if error is not None:
            raise error

    def _at_exit(self) -> None:
        # The process ends without finish(): keep the metrics, and do not leave the run RUNNING.
        try:
            self.finish("KILLED")
        except Exception as exc:  # pragma: no cover - interpreter shutdown
            logger.warning("could not close MLflow run %s at exit: %s", self.run_id, exc)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            status = "FINISHED"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"
        elif issubclass(exc_type, SystemExit) and exc.code in (0, None):
            status = "FINISHED"
        else:
            status = "FAILED"
        if exc_type is None:
            self.finish(status)
            return
        try:  # do not mask the exception that is propagating
            self.finish(status)
        except Exception as finish_exc:
            logger.warning("closing MLflow run %s failed: %s", self.run_id, finish_exc)

    # ------------------------------------------------------------------ views
    def ui_command(self) -> str:
        """The command that opens this store in the MLflow UI (or, for a server, the run's address)."""
        assert self.uri is not None
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"mlflow ui --backend-store-uri {shlex.quote(self.uri)}"


class NullTracker:
    """The `Tracker` interface doing nothing, for `tracking.enabled=false`: the loop needs no `if`s."""

    def __init__(self) -> None:
        self.run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self.uri: Optional[str] = None
        self.status: Optional[str] = None
        self.nonfinite_counts: dict[str, int] = {}

    @classmethod
    def start(cls, tracking_cfg: Any = None, **kwargs: Any) -> NullTracker:
        """Same signature as `Tracker.start`; opens nothing."""
        return cls()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_params(self, params: Mapping[str, str]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        if self.status is None:
            self.status = status

    def ui_command(self) -> Optional[str]:
        return None

    def __enter__(self) -> NullTracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")


def close_orphan_run(tracker: Tracker, run_id: str) -> bool:
    """Mark `run_id` KILLED if it is still RUNNING (its process is known to be dead); True if it was.

    Best effort, in the store of `tracker`: a run that is not there (another store) is left alone.
    """
    try:
        run = tracker.client.get_run(run_id)
        if run.info.status != "RUNNING":
            return False
        tracker.client.set_terminated(run_id, status="KILLED")
    except Exception as exc:  # MlflowException: not in this store
        logger.info("could not close the earlier run %s: %s", run_id, exc)
        return False
    return True


def start_tracker(tracking_cfg: TrackingConfig, **kwargs: Any) -> Tracker | NullTracker:
    """`Tracker.start(tracking_cfg, **kwargs)` when `tracking_cfg.enabled`, else a `NullTracker`."""
    if not tracking_cfg.enabled:
        return NullTracker()
    return Tracker.start(tracking_cfg, **kwargs)
