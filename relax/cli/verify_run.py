"""`relax-verify-run RUN`: check a run's invariants from MLflow and its checkpoints.

RUN is an MLflow run id, a checkpoint directory (`step_NNNNNN/`) or a save dir (its latest checkpoint is used, and
the MLflow run it names). It checks that every step 0..N-1 is in the run's sample ledger exactly once, that no
sample id is in two places (trained twice, or trained and left out), that each step has rollout_batch_size x
n_samples_per_prompt samples and left out the share of them the run logged, that every metric of the run is
recorded at most once per step and the metrics logged at every step have each step, and that the ledger of the
latest checkpoint is the start of the run's. Exit 0 if all hold, 1 if any does not, 2 if the run cannot be read.
The checks themselves: `relax.runner.ledger` and `relax.tracking.verify`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from relax.metrics import EVAL_PREFIX, REWARD_DROPPED_FRAC, STEP_TIME
from relax.runner import checkpoint
from relax.runner.checkpoint import TRACKING_URI_STATE
from relax.runner.endpoints import tracking_store_unreachable
from relax.runner.ledger import (
    FILE,
    Ledger,
    LedgerError,
    check_dropped,
    check_prefix,
    check_samples,
    check_steps,
    count,
    read_checkpoint,
)
from relax.tracking.mlflow_run import CHECKPOINT_DIR_TAG, PARENT_RUN_ID_TAG, bound_http_retries
from relax.tracking.params import TAG_SWEEP_ID
from relax.tracking.progress import steps_name
from relax.tracking.spool_file import is_store_error, short_error
from relax.tracking.verify import (
    UNFINISHED,
    URI_ENV,
    RunRecord,
    VerifyError,
    check_metric_steps,
    child_runs,
    completed_steps,
    default_uri,
    read_run,
    steps_text,
)

OK_EXIT, VIOLATION_EXIT, USAGE_EXIT = 0, 1, 2
EVERY_STEP = (STEP_TIME, REWARD_DROPPED_FRAC)  # metrics the training loop logs at every step, whatever the config
# the flattened config fields (MLflow params, a checkpoint's `config`) that set the samples of a step
BATCH_PARAM, GROUP_PARAM, URI_PARAM = "rollout.rollout_batch_size", "rollout.n_samples_per_prompt", "tracking.uri"
NUM_ROLLOUT_PARAM = "train.num_rollout"  # 0: an evaluation-only run


class UsageError(Exception):
    """Nothing to verify: the run, the store or the checkpoint cannot be found or read."""


@dataclass
class Report:
    title: str
    facts: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    # what an OK says was checked
    checked: str = "every step is in the ledger once, no sample is trained twice, every metric is recorded at most " \
                   "once a step"

    @property
    def ok(self) -> bool:
        return not self.violations

    def text(self) -> str:
        width = max((len(k) for k, _ in self.facts), default=0)
        lines = [self.title, *(f"  {k.ljust(width)}  {v}" for k, v in self.facts)]
        lines += [f"  note: {n}" for n in self.notes]
        if self.ok:
            lines.append(f"OK: {self.checked}")
        else:
            n = len(self.violations)
            lines.append(f"FAILED: {n} violation{'s' if n > 1 else ''}")
            lines += [f"  - {v}" for v in self.violations]
        return "\n".join(lines)


def _checkpoint_of(path: Path) -> tuple[Path, dict]:
    """The checkpoint `path` designates (itself, or the latest of a save dir) and its state.json."""
    if not path.is_dir():
        raise UsageError(f"{path} is not a directory (expected an MLflow run id, a checkpoint directory or a save dir)")
    found = path if (path / checkpoint.STATE).is_file() else checkpoint.latest(path)
    if found is None:
        raise UsageError(f"no checkpoint in {path} (expected {checkpoint.STATE} or {checkpoint.PREFIX}* directories)")
    file = found / checkpoint.STATE
    try:
        state = json.loads(file.read_bytes())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{file} cannot be read: {exc}") from None
    if not isinstance(state, dict) or type(state.get("step")) is not int:
        raise UsageError(f"{file} is not a checkpoint's state (a JSON object with an integer 'step')")
    return found, state


def _run_checkpoint(record: RunRecord, report: Report) -> tuple[Optional[Path], Optional[dict]]:
    """The latest checkpoint of the run, found through its checkpoint-directory tag, if it is still there."""
    tagged = record.tags.get(CHECKPOINT_DIR_TAG)
    if not tagged:
        report.notes.append("the run names no checkpoint directory (train.save=false, or an older relax-train); "
                            "give the directory instead of the run id to compare its checkpoint")
        return None, None
    path = checkpoint.latest(Path(tagged))
    if path is None:
        report.notes.append(f"no checkpoint in {tagged} (the run's checkpoint directory) to compare")
        return None, None
    found, state = _checkpoint_of(path)
    if state.get("mlflow_run_id") != record.run_id:
        report.notes.append(f"the latest checkpoint in {tagged} belongs to MLflow run {state.get('mlflow_run_id')}, "
                            "not this one: not compared")
        return None, None
    return found, state


def _per_step(params: dict, report: Report) -> Optional[int]:
    try:
        b, g = int(params[BATCH_PARAM]), int(params[GROUP_PARAM])
    except (KeyError, ValueError):
        report.notes.append(f"no {BATCH_PARAM} and {GROUP_PARAM} params: the samples of a step are not counted")
        return None
    report.facts.append(("samples a step", f"{b * g} ({BATCH_PARAM}={b} x {GROUP_PARAM}={g})"))
    return b * g


def _ledger_facts(ledger: Ledger, report: Report) -> None:
    trained = sum(count(e.trained) for e in ledger.entries)
    left = sum(count(e.left_out) for e in ledger.entries)
    aside = sum(count(e.set_aside) for e in ledger.entries)
    extra = f", {aside} set aside by dynamic sampling" if aside else ""
    report.facts.append(("ledger", f"{len(ledger)} steps, {trained} samples trained, {left} left out{extra}"))


def _evaluation_only(record: RunRecord, report: Report) -> Report:
    """An evaluation-only run (`train.num_rollout=0`): no step, sample or checkpoint to check; its eval metrics, each
    recorded once, at the step of the weights it evaluated (0, or a checkpoint's), and nothing else."""
    histories = {key: [s for s, _ in h] for key, h in record.histories.items()}
    evals = sorted(key for key in histories if key.startswith(EVAL_PREFIX))
    steps = sorted({s for key in evals for s in histories[key]})
    report.checked = "evaluation only, every eval metric recorded once and no training metric"
    report.facts.append(("evaluation only", f"{len(evals)} eval metric{'s' if len(evals) != 1 else ''} at step "
                                            f"{steps_text(steps)} (train.num_rollout=0: no step trained)"))
    if not evals and record.status not in UNFINISHED:
        report.violations.append("the run logged no eval/* metric (an evaluation-only run logs its evaluation)")
    # an eval key at most once a step, within 0..its evaluation's step; any other key is outside the run's no steps
    report.violations += check_metric_steps(histories, max(steps, default=0), ())
    try:
        trained = Ledger.loads(record.artifact, f"artifact {FILE} of run {record.run_id}").steps \
            if record.artifact is not None else []
    except LedgerError as exc:
        report.violations.append(str(exc))
    else:
        if trained:
            report.violations.append(f"the run's {FILE} records trained {steps_name(trained)}, but an "
                                     "evaluation-only run trains none")
    return report


def _is_sweep_parent(record: RunRecord) -> bool:
    """A sweep's parent run (relax-train -m): tagged with the sweep's id, nested under no run, and without steps or
    config of its own (its jobs' runs have them)."""
    return (TAG_SWEEP_ID in record.tags and PARENT_RUN_ID_TAG not in record.tags and not record.histories
            and NUM_ROLLOUT_PARAM not in record.params)


def _sweep_parent_text(record: RunRecord) -> str:
    """Nothing to check in a sweep's parent run: say so, and name its jobs' runs to verify instead."""
    jobs = child_runs(record.uri, record.run_id)
    head = (f"MLflow run {record.run_id} is the parent run of sweep {record.tags[TAG_SWEEP_ID]}: it has no steps of "
            "its own (each job of the sweep trains in a run of its own)")
    if not jobs:
        return f"{head}, and no run in {record.uri} is nested under it (no job opened one)"
    listed = "\n".join(f"  {run_id}  {status}" + (f"  job {key.rpartition('/')[2]}" if key else "")
                        for run_id, status, key in jobs)
    return f"{head}; verify its jobs' runs, e.g. relax-verify-run {jobs[0][0]}:\n{listed}"


def verify(target: str, uri: Optional[str] = None) -> Report:
    """Check the run `target` (an MLflow run id, a checkpoint directory or a save dir) in store `uri` (default:
    $MLFLOW_TRACKING_URI, else the checkpoint's tracking.uri, else sqlite:///mlflow.db). UsageError if there is nothing
    to check."""
    path = Path(target).expanduser()
    ckpt, state, run_id, given = None, None, target, uri
    if path.exists():
        ckpt, state = _checkpoint_of(path)
        run_id = state.get("mlflow_run_id")
    elif "/" in target or target.startswith("."):
        raise UsageError(f"{target}: no such directory")
    if uri is None:
        # the store the run resolved (state.json, since it is kept there), else its tracking.uri as configured, which
        # a relative one (the default sqlite:///mlflow.db) makes this directory's
        configured = (state.get(TRACKING_URI_STATE) or (state.get("config") or {}).get(URI_PARAM)) if state else None
        uri = default_uri(configured if isinstance(configured, str) else None)
    if run_id is not None:  # a server that is not there: said in seconds, where MLflow's client retries for minutes
        option = "--uri" if given else URI_ENV if os.environ.get(URI_ENV) else "the run's tracking.uri"
        if (why := tracking_store_unreachable(uri, option)) is not None:
            raise UsageError(why)
        bound_http_retries(uri)  # one that goes away meanwhile: seconds too (the user's MLFLOW_HTTP_* win)

    if run_id is None and ckpt is not None and state is not None:  # tracking.enabled=false: only the checkpoint
        report = Report(f"relax-verify-run: checkpoint {ckpt} (no MLflow run: tracking was off)")
        report.facts.append(("steps", f"{state['step']} (the checkpoint's)"))
        per_step = _per_step(state.get("config") or {}, report)
        try:
            ledger = read_checkpoint(ckpt, state)
        except LedgerError as exc:
            report.violations.append(str(exc))
            return report
        if ledger is None:
            report.violations.append(f"checkpoint {ckpt} has no {FILE} (written before sample ledgers)")
            return report
        _ledger_facts(ledger, report)
        report.violations += check_steps(ledger.steps, state["step"], "the checkpoint's ledger")
        report.violations += check_samples(ledger, per_step)
        return report

    try:
        record = read_run(uri, run_id, FILE)
    except VerifyError as exc:
        raise UsageError(str(exc)) from None
    if _is_sweep_parent(record):
        raise UsageError(_sweep_parent_text(record))
    report = Report(f"relax-verify-run: MLflow run {record.run_id} ({record.status}) in {record.uri}")
    if record.params.get(NUM_ROLLOUT_PARAM) == "0":
        return _evaluation_only(record, report)
    if ckpt is None:
        ckpt, state = _run_checkpoint(record, report)

    # the run's ledger (the MLflow artifact) and how many steps the run completed
    ledger = None
    strict = record.status not in UNFINISHED
    if record.artifact is None and not strict:
        report.notes.append(f"the run is {record.status} and has no {FILE} artifact yet (written at its first "
                            "checkpoint): its samples are not checked")
    elif record.artifact is None:
        report.violations.append(f"the run has no {FILE} artifact: its samples cannot be checked (a relax-train "
                                 "from before sample ledgers)")
    else:
        try:
            ledger = Ledger.loads(record.artifact, f"artifact {FILE} of run {record.run_id}")
        except LedgerError as exc:
            report.violations.append(str(exc))
    histories = {key: [s for s, _ in h] for key, h in record.histories.items()}
    ledger_n = 1 + max(ledger.steps, default=-1) if ledger is not None else 0
    metric_n = completed_steps(histories, EVERY_STEP)
    n = max(ledger_n, metric_n)
    report.facts.append(("steps", f"{n}: {steps_name(range(n))}"))
    per_step = _per_step(record.params, report)

    if ledger is not None:
        _ledger_facts(ledger, report)
        report.violations += check_steps(ledger.steps, n if strict else ledger_n, "the run's ledger")
        report.violations += check_samples(ledger, per_step)
        dropped = dict(record.histories.get(REWARD_DROPPED_FRAC, []))
        report.violations += check_dropped(ledger, dropped)
        if not strict and metric_n > ledger_n:
            report.notes.append(f"the run is {record.status}: {steps_name(range(ledger_n, metric_n))} are in "
                                f"MLflow but not yet in its ledger (written at each checkpoint and at the end of the "
                                f"run); train.resume=auto continues it")
    report.facts.append(("metrics", f"{len(histories)} keys, {', '.join(EVERY_STEP)} logged at every step"
                         if histories else "none logged"))
    report.violations += check_metric_steps(histories, n, EVERY_STEP)

    if ckpt is not None and state is not None:
        step = state["step"]
        if state.get("mlflow_run_id") != record.run_id:
            report.violations.append(f"checkpoint {ckpt} names MLflow run {state.get('mlflow_run_id')}, not "
                                     f"{record.run_id}")
        try:
            saved = read_checkpoint(ckpt, state)
        except LedgerError as exc:
            report.violations.append(str(exc))
            saved = None
        else:
            if saved is None:
                report.violations.append(f"checkpoint {ckpt} has no {FILE} (written before sample ledgers)")
        if saved is not None and ledger is not None:
            found = check_prefix(saved, step, ledger)
            report.violations += found
            report.facts.append(("checkpoint", f"{ckpt} (step {step}): its ledger "
                                 + ("starts the run's" if not found else "does not start the run's")))
        else:
            report.facts.append(("checkpoint", f"{ckpt} (step {step})"))
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relax-verify-run",
        description="Check a run's invariants from MLflow and its checkpoints: every step trained once, every sample "
                    "trained at most once, every step's metrics recorded exactly once, the latest checkpoint's ledger "
                    "the start of the run's. Exit 0 if all hold, 1 if not, 2 if the run cannot be read.",
    )
    p.add_argument("run", help="an MLflow run id, a checkpoint directory (step_NNNNNN) or a save dir (its latest "
                               "checkpoint, and the MLflow run it names)")
    p.add_argument("--uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the store the checkpoint's run "
                        "was recorded in when RUN is a directory, else sqlite:///mlflow.db)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = verify(args.run, args.uri)
    except UsageError as exc:
        print(f"relax-verify-run: error: {exc}", file=sys.stderr)
        return USAGE_EXIT
    except Exception as exc:
        if not is_store_error(exc):  # a bug: its traceback is the report
            raise
        print(f"relax-verify-run: error: cannot read the MLflow store: {short_error(exc)}", file=sys.stderr)
        return USAGE_EXIT
    print(report.text())
    return OK_EXIT if report.ok else VIOLATION_EXIT


if __name__ == "__main__":
    sys.exit(main())
