"""What `relax-verify-run` reads from MLflow (one run: status, params, tags, metric histories, an artifact) and its
check of the metric histories. The checks of the sample ledger are in `relax.runner.ledger`; the command itself is
`relax.cli.verify_run`."""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from relax.metrics import EVAL_PREFIX, SYSTEM_PREFIX
from relax.tracking.mlflow_run import file_store_refused, quiet_mlflow_logging, resolve_tracking_uri, sqlite_path
from relax.tracking.progress import ranges_text, steps_name
from relax.tracking.spool_file import is_rejection, short_error

DEFAULT_URI = "sqlite:///mlflow.db"  # relax-train's default tracking.uri (and relax-compare's --uri)
URI_ENV = "MLFLOW_TRACKING_URI"
_PROGRESS_BAR_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
UNFINISHED = ("RUNNING", "SCHEDULED", "KILLED")  # runs whose last steps may not be in their ledger artifact yet


class VerifyError(RuntimeError):
    """The store or the run cannot be read (a usage error: nothing was checked)."""


@dataclass
class RunRecord:
    """One MLflow run as `relax-verify-run` reads it. `histories`: key -> [(step, value)] in the store's order, for
    the metrics logged per training step (system metrics, sampled in time with steps of their own, are left out)."""

    run_id: str
    uri: str
    status: str
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    histories: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    artifact: Optional[str] = None  # the text of the requested artifact, None if the run has none

    def steps_of(self, key: str) -> list[int]:
        return [s for s, _ in self.histories.get(key, [])]


def default_uri(configured: Optional[str] = None) -> str:
    """$MLFLOW_TRACKING_URI, else `configured` (a run's tracking.uri), else relax-train's default store
    (`sqlite:///mlflow.db` in the current directory)."""
    return os.environ.get(URI_ENV) or configured or DEFAULT_URI


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """MLflow draws a progress bar on stderr for every artifact download, one small file included."""
    before = os.environ.get(_PROGRESS_BAR_ENV)
    os.environ[_PROGRESS_BAR_ENV] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_PROGRESS_BAR_ENV, None)
        else:
            os.environ[_PROGRESS_BAR_ENV] = before


def read_run(uri: str, run_id: str, artifact: str) -> RunRecord:
    """Run `run_id` of store `uri` with the history of every metric but the system ones (`RunRecord`) and the text
    of `artifact` (None if absent).

    VerifyError naming the store or the run if either is not there, or the store cannot be reached."""
    quiet_mlflow_logging()
    from mlflow import MlflowClient

    uri = resolve_tracking_uri(uri)
    db = sqlite_path(uri)
    if db is not None and not os.path.isfile(db):  # MlflowClient would create an empty store there
        raise VerifyError(f"no tracking store at {uri} (run from the directory of your runs, or pass --uri)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            client = MlflowClient(tracking_uri=uri)
            run = client.get_run(run_id)
        except Exception as exc:
            if (refused := file_store_refused(uri, exc)) is not None:
                raise VerifyError(refused) from None
            if is_rejection(exc):
                raise VerifyError(f"no MLflow run {run_id!r} in the store {uri}") from None
            raise VerifyError(f"cannot read MLflow run {run_id!r} from {uri}: {short_error(exc)}") from None
        try:
            histories = {key: [(int(m.step), float(m.value)) for m in client.get_metric_history(run_id, key)]
                         for key in sorted(run.data.metrics) if not key.startswith(SYSTEM_PREFIX)}
        except Exception as exc:
            raise VerifyError(f"cannot read the metrics of MLflow run {run_id} from {uri}: {short_error(exc)}") \
                from None
        text = None
        with tempfile.TemporaryDirectory(prefix="relax-verify-") as tmp, _no_progress_bar():
            try:
                text = Path(client.download_artifacts(run_id, artifact, tmp)).read_text()
            except Exception:  # MlflowException, OSError: the run has no such artifact
                text = None
    return RunRecord(run_id, uri, run.info.status, dict(run.data.params), dict(run.data.tags), histories, text)


def child_runs(uri: str, run_id: str) -> list[tuple[str, str, Optional[str]]]:
    """(run id, status, `relax.sweep_job` tag) of each run nested under `run_id` (`mlflow.parentRunId`), in any
    experiment of store `uri`, oldest first; [] when there are none or the store cannot be searched."""
    quiet_mlflow_logging()
    from mlflow import MlflowClient

    from relax.tracking.mlflow_run import PARENT_RUN_ID_TAG

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            client = MlflowClient(tracking_uri=resolve_tracking_uri(uri))
            experiments = [e.experiment_id for e in client.search_experiments()]
            runs = client.search_runs(experiments, filter_string=f"tags.`{PARENT_RUN_ID_TAG}` = '{run_id}'",
                                      max_results=5000)
        except Exception:  # noqa: BLE001 - the caller's message still names the run and its sweep
            return []
    return [(r.info.run_id, r.info.status, r.data.tags.get("relax.sweep_job"))  # the sweep launcher's JOB_TAG
            for r in sorted(runs, key=lambda r: r.info.start_time or 0)]


def completed_steps(histories: Mapping[str, Sequence[int]], every_step: Sequence[str]) -> int:
    """1 + the highest step of the keys logged at every step (0 if none was logged)."""
    return 1 + max((s for key in every_step for s in histories.get(key, ())), default=-1)


def steps_text(steps: Sequence[int]) -> str:
    """Steps as compact sorted text: "0..3, 5, 7..9" ("none" if empty): MLflow's numbers, as for an evaluation's step
    (the number of training steps in the weights it evaluated, which the progress line's `step k/N` names too).
    Training steps (loop indices) are named with `relax.tracking.progress.steps_name`."""
    return ranges_text(steps)


def check_metric_steps(histories: Mapping[str, Sequence[int]], n: int, every_step: Sequence[str]) -> list[str]:
    """Every key (key -> its logged steps) has each step at most once and none from `n` on, but for an evaluation's
    (`eval/...`) at step `n`: an evaluation is logged at the number of training steps in the weights it evaluated
    (`Session.log_evaluation`), so the evaluation after the last step, and that of an evaluation-only run of the
    final checkpoint, are at `n`; the `every_step` keys have each of steps 0..n-1. The violations, as text: a
    training metric's steps named as the progress line counts them (`steps_name`), an evaluation's by MLflow's step
    (the number of steps trained, which the progress line's `step k/N` names too)."""
    problems = []
    for key in sorted(histories):
        counts = Counter(histories[key])
        evaluation = key.startswith(EVAL_PREFIX)

        def at(steps: list[int]) -> str:
            return f"MLflow step(s) {steps_text(steps)}" if evaluation else steps_name(steps)  # noqa: B023 (now)

        twice = sorted(s for s, k in counts.items() if k > 1)
        if twice:
            problems.append(f"metric {key} is recorded more than once at {at(twice)}")
        last = n if evaluation else n - 1  # the last step a key may be recorded at
        beyond = sorted(s for s in counts if s > last or s < 0)
        if beyond:
            problems.append(f"metric {key} is recorded at {at(beyond)}, outside the run's "
                            + (f"MLflow steps 0..{last}" if evaluation else f"{n} steps"))
    for key in every_step:
        if n and key not in histories:
            problems.append(f"metric {key} (logged at every step) is not in the run")
            continue
        missing = sorted(set(range(n)) - set(histories.get(key, ())))
        if missing:
            problems.append(f"metric {key} (logged at every step) is missing {steps_name(missing)}")
    return problems
