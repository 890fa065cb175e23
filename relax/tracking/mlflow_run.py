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

The store unavailable mid-run (sqlite locked, a tracking server down or timing out): training goes on. A write
that fails with a store error (metrics, params, tags, artifacts, dataset inputs, the final run status) is appended to
the run's local spool (`relax.tracking.spool_file`: JSONL, fsync'ed; `spool_dir`, the checkpoint directory under
relax-train), and so is every later write while the spool is not empty, each step (metrics go to disk at every step
then).
One warning names the store and the spool the first time; later failures are only counted (`stats`). Each step
(and the writer every `flush_interval_s`) first replays the spool in order, with the original steps and
timestamps, never writing a value twice; once it is empty, writes go to the store again. `flush()` returns when
everything is in the store or in the spool, so checkpoints keep being committed during an outage; with the writer
thread it waits at most `run_writer.FLUSH_WAIT_S` for the store, then spools (the caller never waits on the network).
For an http(s) store MLflow's HTTP retries are bounded in this process (`HTTP_POLICY`, unless the user set them).
At `finish` the spool is replayed with retries for up to `final_replay_s`; if the store is still down the run ends
anyway and prints where the spool is and the command that loads it later (`python -m relax.tracking.spool <file>`).

The store unavailable at the start (the run cannot be created, or a resumed run cannot be read): `start` and
`reopen` raise `TrackingUnavailable` naming the URI, before anything is trained. A wrong `tracking.uri` is a
configuration error and must fail early; there is no run yet that a spool could belong to, and retrying a
store that is down before the first step only delays that answer (MLflow itself already waits: sqlite's 20 s
busy timeout, its HTTP client's retries). Only an outage after the run exists is survived.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, TypeVar

from relax.metrics import SYSTEM_PREFIX
from relax.tracking.db_store import driver_problem
from relax.tracking.git_info import MLFLOW_GIT_COMMIT_TAG, git_tags
from relax.tracking.inputs import DatasetRecord
from relax.tracking.null_tracker import RUN_STATUSES, NullTracker
from relax.tracking.params import PARAM_VALUE_MAX_LEN, TAG_SWEEP_ID, truncate_value
from relax.tracking.progress import steps_name
from relax.tracking.run_options import DEFAULT_RUN_OPTIONS, RunOptions
from relax.tracking.run_writer import (  # noqa: F401 (MAX_METRICS_PER_BATCH: MLflow's limit, re-exported)
    CLOSE_JOIN_S,
    MAX_METRICS_PER_BATCH,
    RunWriter,
    chunks,
)
from relax.tracking.spool_file import (
    REPLAY_COMMAND,
    SPOOL_PREFIX,
    SPOOL_SUFFIX,
    Spool,
    is_rejection,
    is_store_error,
    short_error,
    spool_path,
)
from relax.tracking.system_metrics import SystemMetrics
from relax.writable import nearest_existing, try_writing

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from relax.config.schema import TrackingConfig

logger = logging.getLogger(__name__)

# MLflow's per-call and per-value limits (mlflow.utils.validation; a test checks they agree).
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_TAG_VALUE_LEN = 8000

PARENT_RUN_ID_TAG = "mlflow.parentRunId"  # what the MLflow UI nests child runs by
NONFINITE_TAG = "relax.nonfinite_metrics"
TRACKING_URI_TAG = "relax.tracking_uri"
RESUMED_TAG = "relax.resumed"  # a reopened run: at which step and from where it was last continued
CHECKPOINT_DIR_TAG = "relax.checkpoint_dir"  # where relax-train writes the run's checkpoints (relax-verify-run)
# a run reopened by a job of another sweep (a sweep resumed with train.resume): the sweep and parent it had before
PREVIOUS_SWEEP_TAG = "relax.previous_sweep_id"
PREVIOUS_PARENT_TAG = "relax.previous_parent_run_id"
NONFINITE_MODES = ("skip", "log")

T = TypeVar("T")


class TrackingUnavailable(RuntimeError):
    """The store cannot be reached when a run starts or is reopened (see the module docstring)."""


class TrackingRefused(TrackingUnavailable):
    """The store answers but cannot take the run as configured (tracking.experiment is deleted there): the user's
    to fix, reported in one line wherever TrackingUnavailable is."""


def deleted_experiment(experiment: str, experiment_id: str, uri: str) -> str:
    """The message for a new run in `experiment` (id `experiment_id`), deleted in store `uri`."""
    return (f"MLflow experiment {experiment!r} (id {experiment_id}) is deleted in {uri}; restore it (mlflow "
            f"experiments restore --experiment-id {experiment_id}) or choose another tracking.experiment")


def experiment_problem(uri: str, experiment: str, cwd: Optional[str] = None) -> Optional[str]:
    """Why a new run cannot be opened in `experiment` of the store at tracking.uri `uri`: it is deleted there (what
    `Tracker.start` refuses, after Ray has started), else None. A check before anything starts
    (`relax.runner.preflight`'s `tracking`), which changes nothing: only a sqlite database that exists (and is not
    empty: MLflow would create its tables) or an HTTP(S) server is opened (the caller probes a server first); any
    other failure to read the store is left to the start, which names it."""
    resolved = resolve_tracking_uri(uri, cwd)
    db = sqlite_path(resolved)
    if db is not None:
        if not (os.path.isfile(db) and os.path.getsize(db) > 0):
            return None
    elif not resolved.lower().startswith(("http://", "https://")):
        return None
    bound_http_retries(resolved)
    quiet_mlflow_logging()
    from mlflow import MlflowClient

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(mlflow|sqlalchemy)\.")
            found = MlflowClient(tracking_uri=resolved).get_experiment_by_name(experiment)
    except Exception:  # noqa: BLE001 - not this check's to report: the start names it, as before
        return None
    if found is None or found.lifecycle_stage != "deleted":
        return None
    return f"tracking.experiment={experiment}: " + deleted_experiment(experiment, found.experiment_id, resolved)


FILE_STORE_OPT_IN = "MLFLOW_ALLOW_FILE_STORE"  # MLflow 3's opt-in to its file store, named in its refusal


def file_store_refused(uri: str, exc: BaseException) -> Optional[str]:
    """What to do about `exc` when it is MLflow's refusal of a file store (a plain directory or a `file:` URI: MLflow
    3 keeps that backend in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE=true), else None."""
    if FILE_STORE_OPT_IN not in str(exc):
        return None
    import mlflow

    path = uri[len("file://"):] if uri.startswith("file://") else uri
    what = ("is a file store (a directory)" if os.path.isdir(path) else
            "does not exist; as a path it names a file store (a directory)")
    return (f"the MLflow store {uri} {what}, which MLflow {mlflow.__version__} refuses: use a "
            f"database store, e.g. sqlite:///{os.path.join(path, 'mlflow.db')} (`mlflow migrate-filestore` moves an "
            f"existing one), or set {FILE_STORE_OPT_IN}=true to use it anyway")


def _unavailable_at_start(uri: str, exc: BaseException, what: str) -> TrackingUnavailable:
    return TrackingUnavailable(
        f"MLflow store {uri} is unavailable when {what} ({short_error(exc)}); nothing was trained. Check tracking.uri "
        "(a wrong URI fails here, before training) or bring the store up, then run again. (A store that goes away "
        "during a run does not stop it: its writes are spooled to local disk and replayed.)"
    )


class _StoreNoiseFilter(logging.Filter):
    """Drops what MLflow and urllib3 log at every failed write (the tracker reports an outage once itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if record.name == "mlflow.store.db.utils":
            return not msg.startswith("SQLAlchemy database error")
        if record.name.startswith("urllib3"):
            return not (msg.startswith("Retrying") and "/mlflow/" in record.getMessage())
        return True


_NOISE_FILTER = _StoreNoiseFilter()


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
    def log_inputs(self, datasets: Sequence[DatasetRecord]) -> None: ...
    def flush(self) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...
    def ui_command(self) -> Optional[str]: ...


# MLflow's HTTP client policy for an http(s) store, set in this process where the user has not set it: MLflow's own
# default (7 retries, backoff factor 2, 120 s a request) holds a write to a store that is down for about 4 minutes,
# and a write waits on it (the writer thread, the end of the run, a tag or artifact written by the caller). Relax
# retries through its spool instead, so one retry, no long backoff and 10 s a request (MLflow reads these from the
# environment at every request: relax.tracking.run_writer is not held by them before a checkpoint in any case)
HTTP_POLICY = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def bound_http_retries(uri: str) -> dict[str, str]:
    """For an http(s) tracking `uri`, MLflow's HTTP retry and time-out variables (`HTTP_POLICY`) set in this process,
    each only where the environment does not set it already (the user's value wins). Returns those it set."""
    if not uri.lower().startswith(("http://", "https://")):
        return {}
    set_here = {k: v for k, v in HTTP_POLICY.items() if not os.environ.get(k)}
    os.environ.update(set_here)
    return set_here


def quiet_mlflow_logging() -> None:
    """Silence MLflow's INFO chatter (e.g. "Creating initial MLflow database tables...") and alembic's.

    They appear on every new sqlite store and drown the live progress line; warnings still show.
    """
    for name in ("mlflow.store.db.utils", "mlflow.store.tracking.sqlalchemy_store", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in ("mlflow.store.db.utils", "urllib3.connectionpool"):
        log = logging.getLogger(name)
        if _NOISE_FILTER not in log.filters:
            log.addFilter(_NOISE_FILTER)


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


def sqlite_store_problem(uri: str, cwd: Optional[str] = None) -> Optional[str]:
    """Why the sqlite store of tracking.uri `uri` cannot be opened for writing, else None (not a sqlite file URI, or
    no problem): its file is not a writable regular file, or its directory cannot be created or written (sqlite
    writes its journal beside the database). A check before anything starts (`relax.runner.preflight`'s
    `tracking`): what `Tracker.start` would find later, after Ray has started. It changes nothing: the database is
    opened without writing, and writability is tried with an empty file made and removed at once (`relax.writable`:
    permission bits say nothing for root, nor for a read-only or virtual filesystem such as /proc)."""
    db = sqlite_path(resolve_tracking_uri(uri, cwd))
    if db is None:
        return None
    where = f"tracking.uri={uri}: the MLflow store {db}"
    fix = ("; set tracking.uri to a sqlite file in a writable directory (e.g. sqlite:///mlflow.db, in the working "
           "directory) or tracking.enabled=false")
    directory = os.path.dirname(db) or "."
    if os.path.isdir(db):
        return f"{where} is a directory, not a database file{fix}"
    existing = str(nearest_existing(Path(directory)))
    if not os.path.isdir(existing):
        return f"{where} cannot be created: {existing} is not a directory{fix}"
    try:
        try_writing(Path(existing))
    except OSError as exc:
        what = ("cannot be written" if Path(existing) == Path(directory)
                else f"cannot be created ({directory} does not exist)")
        return f"{where} {what}: nothing can be created in {existing} ({exc.strerror or exc}){fix}"
    if os.path.exists(db):
        try:
            os.close(os.open(db, os.O_RDWR))
        except OSError as exc:
            return f"{where} cannot be written ({exc.strerror or exc}){fix}"
    return None


def file_store_problem(uri: str, cwd: Optional[str] = None) -> Optional[str]:
    """Why MLflow would refuse tracking.uri `uri` as a file store (a plain directory or a `file:` URI), else None (not
    a file store, or accepted): the message `Tracker.start` raises, for a check before anything starts
    (`relax.runner.preflight`'s `tracking`). The installed MLflow decides, as it will at the start: a file store is
    opened in a fresh temporary directory (MLflow 3 refuses it there as anywhere unless MLFLOW_ALLOW_FILE_STORE=true;
    one that accepts it writes only there), so the user's directory is neither created nor changed."""
    import tempfile

    resolved = resolve_tracking_uri(uri, cwd)
    if not (resolved.startswith("file:") or os.path.isabs(resolved)):
        return None
    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory(prefix=".relax-probe-") as tmp:
        quiet_mlflow_logging()
        try:
            MlflowClient(tracking_uri="file://" + os.path.join(tmp, "mlruns")).search_experiments(max_results=1)
        except Exception as exc:  # noqa: BLE001 - any other failure is the start's to report, as before
            if (refused := file_store_refused(resolved, exc)) is not None:
                return f"tracking.uri={uri}: {refused}"
    return None


def default_spool_dir(uri: str) -> str:
    """Where a run's spool goes when no `spool_dir` is given: next to a sqlite database, else the working directory."""
    db = sqlite_path(uri)
    return os.path.dirname(db) if db else os.getcwd()


def run_context_tags() -> dict[str, str]:
    """The tags of MLflow's run context (the environment variable MLFLOW_RUN_CONTEXT, a JSON object), which MLflow
    sets on every run it creates; {} when unset."""
    from mlflow.tracking.context.system_environment_context import SystemEnvironmentContext

    context = SystemEnvironmentContext()
    return {str(k): str(v) for k, v in context.tags().items()} if context.in_context() else {}


def _check_interval(interval_s: Optional[float]) -> None:
    """A system metrics interval (None: off) is a number of seconds > 0 (before a run is created with it)."""
    if interval_s is not None and not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"the system metrics interval must be a number of seconds > 0, got {interval_s}")


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

    Create with `Tracker.start(tracking_cfg, RunOptions(...), ...)` (or continue one with `Tracker.reopen`). Use as
    a context manager so that the run ends FAILED on an exception and KILLED on Ctrl-C instead of staying RUNNING
    forever. Thread-safe: metrics may be logged from several threads (fully-async training).

    With `RunOptions.background=True` (the default) a daemon thread does the writes, so the training thread only
    appends to a list (microseconds); `background=False` writes inside the `log_metrics` call that makes
    a flush due (deterministic, for tests). `stats` counts batches, metrics and seconds spent writing, and
    for outages: store errors, records spooled and replayed. `spool` is the run's spool (see the module docstring).
    """

    def __init__(
        self,
        client: MlflowClient,
        run_id: str,
        experiment_id: str,
        uri: str,
        options: RunOptions = DEFAULT_RUN_OPTIONS,
    ) -> None:
        if options.nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {options.nonfinite!r}")
        if options.flush_every_steps < 1:
            raise ValueError(f"flush_every_steps must be >= 1, got {options.flush_every_steps}")
        self.client = client
        self.run_id: Optional[str] = run_id
        self.experiment_id: Optional[str] = experiment_id
        self.uri: Optional[str] = uri
        self.nonfinite = options.nonfinite
        self.nonfinite_counts: dict[str, int] = {}
        self.status: Optional[str] = None  # set by finish
        self.stats = {"batches": 0, "metrics": 0, "write_s": 0.0, "already_recorded": 0,
                      "store_errors": 0, "spooled_records": 0, "replayed_records": 0}
        # every write goes through the writer; writes the store could not take wait in the spool until replayed
        # (the file appears with the first one)
        spool = Spool(spool_path(options.spool_dir or default_spool_dir(uri), run_id), run_id=run_id, uri=uri)
        self.writer = RunWriter(client, run_id, uri, spool, flush_every_steps=options.flush_every_steps,
                                flush_interval_s=options.flush_interval_s, background=options.background,
                                stats=self.stats)
        self._lock = self.writer.lock  # the buffer's lock also guards what _log_metrics reads and counts
        self._known_keys: set[str] = set()
        self._closing = False
        self._warned_after_finish = False
        self.final_replay_s = options.final_replay_s
        self._stream = options.stream
        # step -> keys the store already holds at that step (a reopened run's steps being recomputed; see `reopen`)
        self._recorded: dict[int, set[str]] = {}
        self.recorded_history: dict[str, list[tuple[int, float]]] = {}  # reopen(keep_history=...): their values
        self.reopened_tags: dict[str, str] = {}  # reopen: the tags the run held before this process reopened it
        self.system_metrics: Optional[SystemMetrics] = None  # see `start_system_metrics`
        atexit.register(self._at_exit)

    @property
    def spool(self) -> Spool:
        """The run's spool (`relax.tracking.spool_file`): writes the store could not take yet."""
        return self.writer.spool

    @property
    def _writer(self) -> Optional[threading.Thread]:
        return self.writer.thread

    @property
    def flush_interval_s(self) -> float:
        """Metrics are written at least this often (seconds), by the writer thread or at the next log call."""
        return self.writer.flush_interval_s

    @flush_interval_s.setter
    def flush_interval_s(self, value: float) -> None:
        self.writer.flush_interval_s = value

    # ------------------------------------------------------------------ start
    @classmethod
    def start(
        cls,
        tracking_cfg: TrackingConfig,
        options: RunOptions = DEFAULT_RUN_OPTIONS,
        *,
        run_name: Optional[str] = None,
        tags: Optional[Mapping[str, str]] = None,
        params: Optional[Mapping[str, str]] = None,
        parent_run_id: Optional[str] = None,
    ) -> Tracker:
        """Open a new run in `tracking_cfg.experiment` (created if missing) at the resolved `tracking_cfg.uri`,
        written and reported as `options` say (`RunOptions`).

        `run_name` overrides `tracking_cfg.run_name` (both None: MLflow picks a name). `parent_run_id`
        sets `mlflow.parentRunId`, which nests this run under a sweep's parent run in the UI. With
        `options.announce`, one line naming the run, the store and the UI command is printed to `options.stream`
        (stderr). `options.spool_dir` holds the run's spool during an outage (default: `default_spool_dir`); spools
        of earlier runs of the same store left there are replayed first. `options.system_metrics_s`: sample MLflow's
        system metrics every that many seconds (`start_system_metrics`); None: none. The run is tagged with the git
        commit and dirty state of Relax and of the working directory's project (`relax.tracking.git_info`).
        TrackingUnavailable if the store cannot be reached; TrackingRefused (one) if tracking.experiment is deleted.
        """
        _check_interval(options.system_metrics_s)
        quiet_mlflow_logging()
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException
        from mlflow.tracking.context.registry import resolve_tags

        uri = resolve_tracking_uri(tracking_cfg.uri)
        bound_http_retries(uri)
        db = sqlite_path(uri)
        try:
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
                    experiment_id = client.create_experiment(tracking_cfg.experiment,
                                                             artifact_location=artifact_location)
                except MlflowException as exc:  # created meanwhile by a sibling job
                    experiment = client.get_experiment_by_name(tracking_cfg.experiment)
                    if experiment is None:
                        raise exc from None
                    experiment_id = experiment.experiment_id
            else:
                if experiment.lifecycle_stage == "deleted":
                    raise TrackingRefused(deleted_experiment(tracking_cfg.experiment, experiment.experiment_id, uri))
                experiment_id = experiment.experiment_id

            system_tags = {k: str(v) for k, v in resolve_tags({}).items()}  # user, source, git commit
            code = git_tags()
            if MLFLOW_GIT_COMMIT_TAG in system_tags:  # MLflow's: the entry script's repository
                code.pop(MLFLOW_GIT_COMMIT_TAG)
            system_tags.update(code)
            system_tags[TRACKING_URI_TAG] = uri
            if parent_run_id is not None:
                system_tags[PARENT_RUN_ID_TAG] = parent_run_id
            run = client.create_run(experiment_id, tags=system_tags, run_name=run_name or tracking_cfg.run_name)
        except TrackingRefused:
            raise
        except Exception as exc:
            if (refused := file_store_refused(uri, exc)) is not None:
                raise TrackingUnavailable(f"tracking.uri={tracking_cfg.uri}: {refused}") from None
            if (no_driver := driver_problem(uri)) is not None:  # a database store whose driver does not import
                raise TrackingUnavailable(no_driver) from None
            if is_store_error(exc) and not is_rejection(exc):
                raise _unavailable_at_start(uri, exc, "the run starts") from exc
            raise
        if options.spool_dir is not None:
            replay_leftover_spools(client, uri, options.spool_dir)
        tracker = cls(client, run.info.run_id, experiment_id, uri, options)
        try:
            if tags:
                tracker.set_tags(tags)
            if params:
                tracker.log_params(params)
        except BaseException:
            tracker.finish("FAILED")
            raise
        return tracker._running(options, 0, options.announce and (
            f"MLflow run {run.info.run_name} ({run.info.run_id}) in experiment {tracking_cfg.experiment!r} at {uri}"))

    @classmethod
    def reopen(
        cls,
        tracking_cfg: TrackingConfig,
        run_id: str,
        options: RunOptions = DEFAULT_RUN_OPTIONS,
        *,
        from_step: int = 0,
        tags: Optional[Mapping[str, str]] = None,
        keep_history: Sequence[str] = (),
        parent_run_id: Optional[str] = None,
    ) -> Tracker:
        """Continue the existing run `run_id` (a resumed training job): status back to RUNNING, same metrics;
        written and reported as `options` say (`RunOptions`).

        `parent_run_id` (a job of a sweep): the run becomes a child of that parent run if it was another's (a sweep
        resumed by a new `relax-train -m ... train.resume=auto`, whose launcher made a new parent and sweep id, which
        `tags` carries): its `mlflow.parentRunId` and its `sweep_id` tag then name the same sweep, the one that
        continued it, and the tags `relax.previous_parent_run_id` and `relax.previous_sweep_id` keep the ones it had.
        None: the run keeps its parent.

        Steps from `from_step` on are recomputed by the resumed job, and some of them may already be in
        the store (written by the killed process after its last checkpoint). The steps each key already
        has from `from_step` on are read once here (one query per key), and `log_metrics` does not write
        those (key, step) pairs again, so every step of every key is recorded exactly once; the value kept
        is the first one written. `keep_history` keys get their values in `recorded_history`, at every step the
        store holds (the caller takes those it needs: the reward before `from_step`, for the end-of-run summary;
        the evaluations up to `from_step`, the one of the resumed weights included); a `keep_history` entry ending
        in "/" keeps every key under that prefix (`eval/`). `reopened_tags`: the run's tags as found. Params are not
        logged again (MLflow params are immutable). System metrics (`options.system_metrics_s`) continue after the
        run's last sample. A spool the killed job left in `options.spool_dir` is replayed before all that.
        LookupError if the run is not in the store or is deleted; TrackingUnavailable if the store cannot be reached
        (or the spool not replayed).
        """
        _check_interval(options.system_metrics_s)
        quiet_mlflow_logging()
        from mlflow import MlflowClient

        uri = resolve_tracking_uri(tracking_cfg.uri)
        bound_http_retries(uri)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(mlflow|sqlalchemy)\.")
                client = MlflowClient(tracking_uri=uri)
                run = client.get_run(run_id)
        except Exception as exc:
            if (refused := file_store_refused(uri, exc)) is not None:
                raise TrackingUnavailable(f"tracking.uri={tracking_cfg.uri}: {refused}") from None
            if (no_driver := driver_problem(uri)) is not None:  # a database store whose driver does not import
                raise TrackingUnavailable(no_driver) from None
            if is_rejection(exc):  # the store answered: no such run
                raise LookupError(f"MLflow run {run_id} is not in the store {uri}: {exc.message}") from None
            if is_store_error(exc):
                raise _unavailable_at_start(uri, exc, f"run {run_id} is reopened") from exc
            raise
        if run.info.lifecycle_stage == "deleted":
            raise LookupError(f"MLflow run {run_id} in {uri} is deleted; restore it (mlflow runs restore --run-id "
                              f"{run_id}) to continue it")
        leftover = Spool(spool_path(options.spool_dir or default_spool_dir(uri), run_id), run_id=run_id, uri=uri)
        if leftover.pending:  # written by the job that was killed, before the recorded steps are read below
            result = leftover.replay(client, run_id, attempts=None, deadline_s=options.final_replay_s)
            leftover.close()
            if not result.done:
                raise _unavailable_at_start(uri, result.error or RuntimeError("replay failed"),
                                            f"the spool {leftover.path} of run {run_id} is replayed")
            logger.info("replayed %d records of %s into run %s", result.records, leftover.path, run_id)
            run = client.get_run(run_id)  # the replayed metrics count as recorded below
        leftover.remove_if_done()
        tracker = cls(client, run_id, run.info.experiment_id, uri, options)
        tracker.reopened_tags = dict(run.data.tags)
        try:
            prefixes = tuple(k for k in keep_history if k.endswith("/"))
            keep = {k for k in run.data.metrics if k in keep_history or (prefixes and k.startswith(prefixes))}
            # the highest step of each key (MLflow's latest metrics): keys that stop before from_step need no query
            last_step = {m.key: m.step for m in getattr(run.data, "_metric_objs", ())}
            system_steps = [s for k, s in last_step.items() if k.startswith(SYSTEM_PREFIX)]
            next_system_step = max(system_steps) + 1 if system_steps else 0
            for key in run.data.metrics:
                if key not in keep and last_step.get(key, from_step) < from_step:
                    continue
                if key.startswith(SYSTEM_PREFIX) and key not in keep:  # samples, never recomputed: continued after
                    continue
                history = client.get_metric_history(run_id, key)
                for m in history:
                    if m.step >= from_step:
                        tracker._recorded.setdefault(int(m.step), set()).add(key)
                if key in keep:
                    tracker.recorded_history[key] = sorted((int(m.step), m.value) for m in history)
            tracker.writer.retry(lambda: client.update_run(run_id, status="RUNNING"))
            # the tags MLflow adds to every run it creates from the process's context (MLFLOW_RUN_CONTEXT: a sweep's
            # launcher names each job's run there, `relax.sweep_job`), now this process's run too; `tags` win
            tags = {**run_context_tags(), **(tags or {})}
            old_parent = run.data.tags.get(PARENT_RUN_ID_TAG)
            if parent_run_id is not None and parent_run_id != old_parent:
                tags[PARENT_RUN_ID_TAG] = parent_run_id
                if old_parent is not None:
                    tags[PREVIOUS_PARENT_TAG] = old_parent
                old_sweep = run.data.tags.get(TAG_SWEEP_ID)
                if old_sweep is not None and old_sweep != tags.get(TAG_SWEEP_ID, old_sweep):
                    tags[PREVIOUS_SWEEP_TAG] = old_sweep
            if tags:
                tracker.set_tags(tags)
        except Exception as exc:
            if is_store_error(exc) and not is_rejection(exc):  # down again: leave the run as the killed job did
                tracker._abandon()
                raise _unavailable_at_start(uri, exc, f"run {run_id} is reopened") from exc
            tracker.finish("FAILED")
            raise
        except BaseException:
            tracker.finish("FAILED")
            raise
        return tracker._running(options, next_system_step, options.announce and (
            f"MLflow run {run.info.run_name} ({run_id}) reopened at {steps_name([from_step])} in experiment "
            f"{tracking_cfg.experiment!r} at {uri}"))

    def _running(self, options: RunOptions, first_system_step: int, announcement: str | bool) -> Tracker:
        """What `start` and `reopen` do last: system metrics sampled (from `first_system_step`), and one line naming
        the run, the store and the UI command (`announcement`; False: none) printed to `options.stream`."""
        if options.system_metrics_s is not None:
            self.start_system_metrics(options.system_metrics_s, first_step=first_system_step)
        if announcement:
            stream = options.stream
            print(f"{announcement}; view: {self.ui_command()}", file=stream if stream is not None else sys.stderr,
                  flush=True)
        return self

    # ---------------------------------------------------------------- logging
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer `metrics` at `step` (cheap); they reach the store at the next flush.

        Values may be anything `float()` accepts (Python/numpy numbers, 1-element tensors). A bad key
        raises ValueError here, at its first use, rather than failing a later batch. In a reopened run,
        (key, step) pairs the store already holds are not written again (see `reopen`). During an outage
        they go to the spool file before this returns.
        """
        self._log_metrics(metrics, step, "log_metrics")

    def log_system_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """`log_metrics` for samples of system metrics, whose `step` is the sample's index: written with the
        training metrics, but not counted as a training step (`flush_every_steps`)."""
        self._log_metrics(metrics, step, "log_system_metrics", training_step=False)

    def start_system_metrics(self, interval_s: float, *, first_step: int = 0) -> None:
        """Sample MLflow's system metrics every `interval_s` seconds (> 0) until `finish`
        (`relax.tracking.system_metrics`); steps from `first_step`. If they cannot be sampled here (psutil missing or
        refused), a warning says so and the run goes on without them."""
        _check_interval(interval_s)
        if self.system_metrics is not None or self._closing:
            return
        try:
            self.system_metrics = SystemMetrics(self.log_system_metrics, interval_s, first_step=first_step).start()
        except Exception as exc:  # a monitoring aid never stops a run
            logger.warning("system metrics are not recorded for MLflow run %s: %s", self.run_id, short_error(exc))

    def _log_metrics(self, metrics: Mapping[str, float], step: int, what: str, training_step: bool = True) -> None:
        ts = int(time.time() * 1000)
        with self._lock:
            if self._closing:
                self._warn_after_finish(what)
                return
            recorded = self._recorded.get(step) if self._recorded else None
            for key, value in metrics.items():
                if key not in self._known_keys:
                    _validate_metric_key(key)
                    self._known_keys.add(key)
                v = float(value)
                if not math.isfinite(v):
                    if key not in self.nonfinite_counts:
                        logger.warning("metric %s is %s at MLflow step %d (%s)", key, v, step, self._nonfinite_action())
                    self.nonfinite_counts[key] = self.nonfinite_counts.get(key, 0) + 1
                    if self.nonfinite == "skip":
                        continue
                if recorded is not None and key in recorded:
                    self.stats["already_recorded"] += 1  # logged before a kill, recomputed after the resume
                    continue
                self.writer.buffer.append((key, v, ts, int(step)))
            due, spooling = self.writer.step_logged(step, training_step)
        if due:
            self.writer.flush_due(spooling)

    def _nonfinite_action(self) -> str:
        return "skipped; counted in tag " + NONFINITE_TAG if self.nonfinite == "skip" else "logged"

    def flush(self) -> None:
        """Put everything logged so far into the store, or (during an outage) into the spool on disk.

        Either way it is durable when this returns. Raises only if neither takes it (e.g. the disk is full) or
        for an error that is not the store's; the metrics then stay buffered.
        """
        if self._closing:
            return
        self.writer.flush()

    def _abandon(self) -> None:
        """Drop this tracker without writing anything (the run is left as it is in the store). Its threads are
        joined for CLOSE_JOIN_S each, as in `finish` (one stuck in a store call is left behind)."""
        if self.system_metrics is not None:
            self.system_metrics.stop(last_sample=False, timeout_s=CLOSE_JOIN_S)
        with self._lock:
            self._closing = True
        atexit.unregister(self._at_exit)
        self.writer.stop(CLOSE_JOIN_S)
        self.spool.close()

    # ---------------------------------------------------------------- params, tags, artifacts
    def log_params(self, params: Mapping[str, str]) -> None:
        """Log params (immutable in MLflow: re-logging a key with another value fails), 100 per call."""
        if self._closed("log_params"):
            return
        self._write_items("params", [(str(k), truncate_value(str(v), PARAM_VALUE_MAX_LEN)) for k, v in params.items()])

    def _write_items(self, op: str, items: Sequence[tuple[str, str]]) -> None:
        """Params or tags, 100 per log_batch call (or one spool record)."""
        from mlflow.entities import Param, RunTag

        cls: Any = Param if op == "params" else RunTag
        done = 0

        def write() -> None:
            nonlocal done
            for chunk in chunks(items[done:], MAX_PARAMS_TAGS_PER_BATCH):
                self.client.log_batch(self.run_id, **{op: [cls(k, v) for k, v in chunk]}, synchronous=True)
                done += len(chunk)

        if items:
            self.writer.store_write(op, {"items": [list(i) for i in items]}, write)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set (or overwrite) run tags, 100 per call; values longer than MLflow's limit are truncated."""
        if self._closed("set_tags"):
            return
        self._write_items("tags", [(str(k), truncate_value(str(v), MAX_TAG_VALUE_LEN)) for k, v in tags.items()])

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store `text` as the artifact `artifact_file` (e.g. "config.yaml", "plan.txt")."""
        if not self._closed("log_text"):
            self.writer.store_write("text", {"text": text, "artifact_file": artifact_file},
                              lambda: self.client.log_text(self.run_id, text, artifact_file))

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        """Copy a local file or directory into the run's artifacts (under `artifact_path` if given)."""
        if not self._closed("log_artifact"):
            self.writer.store_write("artifact", {"path": path, "artifact_path": artifact_path},
                              lambda: self.client.log_artifact(self.run_id, path, artifact_path))

    def log_inputs(self, datasets: Sequence[DatasetRecord]) -> None:
        """Record the run's datasets as MLflow dataset inputs (`relax.tracking.inputs`). Idempotent in the store:
        a dataset already logged to the run (same name and digest) is not added again."""
        if self._closed("log_inputs") or not datasets:
            return
        self.writer.store_write("inputs", {"datasets": [d.to_dict() for d in datasets]},
                          lambda: self.client.log_inputs(self.run_id, datasets=[d.to_mlflow() for d in datasets]))

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
        """Stop the system metrics (their thread is joined), flush and end the run with `status` (FINISHED, FAILED or
        KILLED). Later calls do nothing.

        After an outage the spool is replayed, with retries for up to `final_replay_s`; if the store is still
        down, the run ends all the same and the spool's path and the command that replays it are printed.
        Store errors are not raised; another error of the final flush is, after the run is ended.

        Every wait here is bounded by `CLOSE_JOIN_S` (None: unbounded): the system metrics' sampling thread, the
        writer thread's write in progress, and the final writes (the rest of the metrics, the tags, the status; plus
        `final_replay_s` to replay a spool), which run in a thread of their own so that a store that hangs holds that
        thread and not the caller. A store that does not answer in time gets nothing more: what it did not take goes
        to the spool (`_finish_in_spool`) and the run ends.
        """
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        bound = CLOSE_JOIN_S
        if self.system_metrics is not None:  # its thread ends here; its last sample is written with the rest
            self.system_metrics.stop(timeout_s=bound)
        with self._lock:
            if self._closing:
                return
            self._closing = True  # from here on, logging calls are ignored
        atexit.unregister(self._at_exit)
        t0 = time.monotonic()
        if not self.writer.stop(bound):
            self._finish_in_spool(status, "a write of the writer thread", time.monotonic() - t0)
            return
        outcome: list[Optional[BaseException]] = []

        def final_writes() -> None:
            try:
                outcome.append(self._final_writes(status))
            except BaseException as exc:  # raised by `finish`, in the caller
                outcome.append(exc)

        final = threading.Thread(target=final_writes, name="relax-mlflow-finish", daemon=True)
        t0 = time.monotonic()
        final.start()
        final.join(None if bound is None else bound + self.final_replay_s)
        if final.is_alive():
            self._finish_in_spool(status, "the final writes (metrics, tags, run status)", time.monotonic() - t0)
            return
        self.spool.close()
        if outcome and outcome[0] is not None:
            raise outcome[0]

    def _final_writes(self, status: str) -> Optional[BaseException]:
        """The end of `finish` that talks to the store (in its own thread): the buffer, the tags, the status, the
        spool's replay. Returns the error of the final flush that is not the store's (raised by `finish`)."""
        error: Optional[BaseException] = None
        try:
            self.writer.drain()
            if self.nonfinite_counts and not self.writer.abandoned:
                counts = ", ".join(f"{k}={n}" for k, n in sorted(self.nonfinite_counts.items()))
                self._write_items("tags", [(NONFINITE_TAG, truncate_value(counts, MAX_TAG_VALUE_LEN))])
        except Exception as exc:
            error = exc
            logger.warning("final MLflow flush of run %s failed: %s", self.run_id, exc)
        if self.writer.abandoned:  # `finish` gave up on the store meanwhile: the spool has the rest
            return None
        self.status = status
        end_time = int(time.time() * 1000)
        self.writer.store_write("terminate", {"status": status, "end_time": end_time},
                                lambda: self.client.set_terminated(self.run_id, status=status, end_time=end_time))
        if self.spool.pending and not self.writer.abandoned:
            result = self.writer.replay(attempts=None, deadline_s=self.final_replay_s)
            if not result.done and not self.writer.abandoned:
                print(
                    f"MLflow store {self.uri} is still unavailable at the end of run {self.run_id} "
                    f"({short_error(result.error) if result.error else 'replay failed'}): nothing is lost, "
                    f"{self.spool.describe()} are kept in {self.spool.path}. Once the store is back, load them "
                    f"with:\n    {REPLAY_COMMAND} {shlex.quote(str(self.spool.path))}\n(add --uri URI if the store "
                    "has moved; running it twice writes nothing twice)",
                    file=self._stream if self._stream is not None else sys.stderr, flush=True)
        return error

    def _finish_in_spool(self, status: str, what: str, waited_s: float) -> None:
        """The end of a run whose store hangs: `what` (a write of the writer thread, or the final writes) did not
        come back within CLOSE_JOIN_S (`waited_s` seconds waited). What the hung write holds, the buffer, the tags
        and the final status go to the spool without another call to the store (which would hang too), and the run
        ends here; the printed command replays them. The thread left in the store's call writes nothing more
        (`RunWriter.abandon`): whatever it still held is in the spool."""
        self.writer.abandon()
        self.writer.spool_in_flight()
        self.writer.spool_buffer()
        with self.writer.lock:
            if self.nonfinite_counts:
                counts = ", ".join(f"{k}={n}" for k, n in sorted(self.nonfinite_counts.items()))
                self.spool.append("tags", {"items": [[NONFINITE_TAG, truncate_value(counts, MAX_TAG_VALUE_LEN)]]})
            self.spool.append("terminate", {"status": status, "end_time": int(time.time() * 1000)})
        self.status = status
        print(f"MLflow store {self.uri} did not answer a write of run {self.run_id}: waited {waited_s:.3g} s for "
              f"{what} (relax.tracking.run_writer.CLOSE_JOIN_S={CLOSE_JOIN_S:g} s): nothing is lost, "
              f"{self.spool.describe()} are kept in {self.spool.path}. Once the store answers, "
              f"load them with:\n    {REPLAY_COMMAND} {shlex.quote(str(self.spool.path))}",
              file=self._stream if self._stream is not None else sys.stderr, flush=True)
        self.spool.close()

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
        """The command that opens this store in the MLflow UI (or, for a server, the run's address: `run_url`)."""
        assert self.uri is not None
        url = run_url(self.uri, self.experiment_id, self.run_id)
        return url if url is not None else f"mlflow ui --backend-store-uri {shlex.quote(self.uri)}"


def run_url(uri: str, experiment_id: Optional[str], run_id: Optional[str]) -> Optional[str]:
    """The address of a run in the MLflow UI of a tracking server (`uri` http:// or https://), else None.

    `http://mlflow:5000` -> `http://mlflow:5000/#/experiments/3/runs/<run id>`; a server behind a path prefix keeps it.
    """
    if not uri.lower().startswith(("http://", "https://")) or experiment_id is None or run_id is None:
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def local_store_exists(uri: str) -> bool:
    """Whether resolved tracking URI `uri` is a store on this machine that already exists: a sqlite file, or a file
    store's directory (`file://...` or a plain path). Opening one waits for no server and creates nothing."""
    if (db := sqlite_path(uri)) is not None:
        return os.path.isfile(db)
    if uri.startswith("file://"):
        return os.path.isdir(uri[len("file://") :])
    return os.path.isabs(uri) and os.path.isdir(uri)


def close_orphan_run(tracker: Tracker, run_id: str, uri: Optional[str] = None) -> Optional[str]:
    """Mark `run_id` KILLED if it is still RUNNING (its process is known to be dead); the store it was closed in if
    it was, else None.

    `uri`: the store (resolved tracking URI) the run was recorded in (`Checkpoints.record_run`); None for a record
    written before stores were recorded, taken to be `tracker`'s. A run of another store is closed in that store
    when it is a local one that exists (`local_store_exists`: nothing to wait for); one of another server's store is
    left alone: this job has no business with that server (it may need other credentials, or be down). Best effort:
    a run the store does not hold (a record from before stores were recorded whose run is in another store, or a
    deleted run) is left alone without a word, as is any other; a store error is a warning, never a failure.
    """
    from mlflow.exceptions import MlflowException

    store = tracker.uri if uri is None else uri
    if store == tracker.uri:
        client = tracker.client
    elif store and local_store_exists(store):
        from mlflow import MlflowClient

        with warnings.catch_warnings():  # SQLAlchemy deprecation noise from MLflow's models (as in Tracker.start)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(mlflow|sqlalchemy)\.")
            client = MlflowClient(tracking_uri=store)
    else:
        logger.debug("the earlier run %s is in store %s, not this run's: left alone", run_id, store)
        return None
    try:
        run = client.get_run(run_id)
        if run.info.status != "RUNNING":
            return None
        client.set_terminated(run_id, status="KILLED")
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":  # not in this store: nothing of this store to close
            logger.debug("the earlier run %s is not in store %s: left alone", run_id, store)
        else:
            logger.warning("could not mark the earlier job's MLflow run %s KILLED in %s (it may stay RUNNING): %s",
                           run_id, store, short_error(exc))
        return None
    except Exception as exc:  # a store that fails otherwise (a broken database file): the new run goes on
        logger.warning("could not mark the earlier job's MLflow run %s KILLED in %s (it may stay RUNNING): %s",
                       run_id, store, short_error(exc))
        return None
    return store


def replay_leftover_spools(client: MlflowClient, uri: str, spool_dir: str | os.PathLike[str]) -> None:
    """Best effort: replay the spools of earlier runs of store `uri` left in `spool_dir` (the store was down at
    their end); those that still fail stay, with a warning."""
    for path in sorted(Path(spool_dir).glob(f"{SPOOL_PREFIX}*{SPOOL_SUFFIX}")):
        if path.name.endswith(".rejected.jsonl"):
            continue
        try:
            spool = Spool(path)
            if spool.uri != uri:
                continue
            if spool.pending:
                result = spool.replay(client)
                if not result.done:
                    logger.warning("could not replay the spool %s left by run %s (%s); replay it later with: %s %s",
                                   path, spool.run_id, short_error(result.error) if result.error else "?",
                                   REPLAY_COMMAND, shlex.quote(str(path)))
                    continue
                logger.warning("replayed the spool %s that run %s left (%d records)", path, spool.run_id,
                               result.records)
            spool.remove_if_done()
        except Exception as exc:  # never stop a new run for an old spool
            logger.warning("could not replay the spool %s: %s", path, short_error(exc))


def start_tracker(
    tracking_cfg: TrackingConfig,
    options: RunOptions = DEFAULT_RUN_OPTIONS,
    *,
    run_name: Optional[str] = None,
    tags: Optional[Mapping[str, str]] = None,
    params: Optional[Mapping[str, str]] = None,
    parent_run_id: Optional[str] = None,
) -> Tracker | NullTracker:
    """`Tracker.start(tracking_cfg, options, ...)` when `tracking_cfg.enabled`, else a `NullTracker`."""
    if not tracking_cfg.enabled:
        return NullTracker()
    return Tracker.start(tracking_cfg, options, run_name=run_name, tags=tags, params=params,
                         parent_run_id=parent_run_id)
