"""What a run shows and records: the MLflow run, the progress line and the closing summary."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from relax.config.schema import RelaxConfig
from relax.metrics import EVAL_MEAN_AT, EVAL_PREFIX, EVAL_STEP_TAG, EVAL_STEP_WEIGHTS
from relax.models.write_errors import os_write_error
from relax.runner.checkpoint import TRACKING_URI_STATE, Checkpoints, ResumePoint, config_yaml
from relax.runner.errors import NothingTrained, RunError, step_name
from relax.runner.eval_samples import eval_samples_file, to_jsonl
from relax.runner.ledger import FILE as LEDGER_FILE
from relax.runner.ledger import Ledger, LedgerError, read_checkpoint
from relax.runner.plan import Plan
from relax.runner.step_metrics import RAW_REWARD, final_eval_summary
from relax.tracking.progress import steps_name

if TYPE_CHECKING:
    from relax.data.datasets import PromptDataset
    from relax.runner.restarts import Restarts
    from relax.tracking.inputs import DatasetRecord

# Seconds between background writes of buffered metrics to MLflow (besides every 10 steps and before each
# checkpoint). An environment variable so that it can be changed for a run without changing its config.
FLUSH_INTERVAL_ENV = "RELAX_MLFLOW_FLUSH_S"
DEFAULT_FLUSH_INTERVAL_S = 15.0
FAILURES_STATE = "checkpoint_failures"  # state.json: checkpoints the run could not write before this one


def flush_interval_s() -> float:
    text = os.environ.get(FLUSH_INTERVAL_ENV)
    if text is None or text.strip() == "":
        return DEFAULT_FLUSH_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise RunError(f"{FLUSH_INTERVAL_ENV}={text!r} must be a number of seconds > 0")
    return value


def _hydra_overrides() -> list[str]:
    """The command-line overrides of this job when Hydra runs it (relax-train, sweeps), else []."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return list(HydraConfig.get().overrides.task)


def _eval_set_of(key: str) -> str:
    """The eval set of an eval/<set>/<metric> key (`relax.metrics.eval_metric`)."""
    return key.removeprefix(EVAL_PREFIX).rpartition("/")[0]


def resume_text(resume: ResumePoint) -> str:
    """The `relax.resumed` tag: where the run was last continued from, and the config fields that changed."""
    text = f"step {resume.step} from {resume.path}"
    changed = [f"{k}: {a} -> {b}" for k, (a, b) in resume.changed.items() if k != "train.resume"]
    if changed:
        text += "; changed: " + ", ".join(changed)
    return text


def resume_history_tags(held: Mapping[str, str], text: str) -> dict[str, str]:
    """The tags that record continuation `text` (`resume_text`, or a restart's) of a reopened run whose tags were
    `held`: `relax.resumed` (the last one, overwritten) and `relax.resumed.<n>`, the n-th (1-based), so that every
    continuation stays readable in the run's tags. A run continued by a Relax that kept only the last one has its
    `relax.resumed` value as `relax.resumed.1` (the earlier ones are lost), this one after it."""
    from relax.tracking.mlflow_run import RESUMED_TAG

    prefix = RESUMED_TAG + "."
    numbers = [int(k[len(prefix):]) for k in held if k.startswith(prefix) and k[len(prefix):].isdigit()]
    tags = {RESUMED_TAG: text}
    if not numbers and RESUMED_TAG in held:
        tags[prefix + "1"] = held[RESUMED_TAG]
        numbers = [1]
    tags[f"{prefix}{max(numbers, default=0) + 1}"] = text
    return tags


def dataset_record(name: str, context: str, dataset: PromptDataset, task: str) -> DatasetRecord:
    """How a prompt set is logged (`relax.tracking.inputs`): its source is the file it was read from (a dataset read
    from a file is named by its path), else the synthetic task `task` (`synthetic:<task>`); its digest hashes the
    prompt texts and labels it holds."""
    from relax.tracking.inputs import SOURCE_FILE, SOURCE_SYNTHETIC, DatasetRecord, prompts_digest

    path = Path(dataset.name).expanduser() if dataset.name else None
    if path is not None and path.is_file():
        source_type, source = SOURCE_FILE, str(path.resolve())
    else:
        source_type, source = SOURCE_SYNTHETIC, f"synthetic:{task}"
    return DatasetRecord(name=name, context=context, source_type=source_type, source=source,
                         digest=prompts_digest((item.prompt_text, item.label) for item in dataset),
                         num_prompts=len(dataset), num_dropped=dataset.num_dropped)


def dataset_records(cfg: RelaxConfig, train_set: PromptDataset,
                    eval_sets: Mapping[str, PromptDataset] | None = None) -> list[DatasetRecord]:
    """The run's prompt sets as it logs them to MLflow (`dataset_record`): `train_set` under `data.name` (context
    train), each of `eval_sets` under its eval set name (context eval). Each checkpoint records them too
    (`checkpoint.RUN_DATA`), and a resume checks the files against them (`checkpoint.check_run_data`)."""
    records = [dataset_record(cfg.data.name, "train", train_set, cfg.data.task)]
    return records + [dataset_record(name, "eval", ds, cfg.data.task) for name, ds in (eval_sets or {}).items()]


@dataclass
class RunResult:
    run_id: str | None
    history: list[tuple[int, dict[str, float]]]
    first_reward: float  # mean of the first 10 steps (all of them in a shorter run)
    final_reward: float  # mean of the last 10 steps
    best_reward: float

    def series(self, key: str) -> list[float]:
        return [m[key] for _, m in self.history if key in m]


class Session:
    """The MLflow run (new, or reopened when resuming a checkpoint that names one), progress and summary.

    `checkpoints` (a `relax.runner.checkpoint.Checkpoints`, entered) says where checkpoints go and what the
    run resumes from; `save_checkpoint` commits one only after the metrics it covers are in the store.

    The sample ledger (`relax.runner.ledger`): `record_samples` adds each step's samples to `ledger`. It goes into
    every checkpoint (`ledger.jsonl`, steps before the checkpoint's) and into the MLflow run as the artifact
    `ledger.jsonl`, rewritten whole before each checkpoint and at the end of the run (also a failed or stopped one),
    so that the ledger of any checkpoint is a prefix of the run's. A resumed run continues the ledger of its
    checkpoint (cut to the steps before it), and a reopened run's artifact becomes that job's ledger once it
    records a step (the checkpoint's steps, then the ones it trained: its own checkpoints hold the same, so that
    relax-verify-run checks one history); a job that records no step (an evaluation of a checkpoint, an older one
    included) does not write it, so the run keeps the ledger of the steps it trained.

    The end of the run (`finish`), with `train.save_hf=true`: the final checkpoint (that of step `train.num_rollout`,
    committed by this job or the one it resumed) is exported as a Hugging Face model directory to `<save_dir>/hf`
    (`relax.runner.export`, as `relax-export` does; an earlier export there is replaced), the run's tag `relax.hf_dir`
    names it; with `tracking.log_model=true` that directory is then logged into the MLflow run as a model
    (`relax.tracking.model`, tag `relax.model_uri`). A failed export or log stops the run with a RunError that names
    the (intact) checkpoint or directory and the command that does it again.
    """

    def __init__(self, cfg: RelaxConfig, plan: Plan, output_dir: Path, dictconfig=None,
                 checkpoints: Checkpoints | None = None, restart_run_id: str | None = None,
                 restarts: Restarts | None = None):
        self.cfg, self.plan, self.output_dir, self.dictconfig = cfg, plan, output_dir, dictconfig
        self.checkpoints = checkpoints
        # a restart with nothing to resume (no checkpoint yet): the MLflow run of the attempt before, from the first
        # step
        self.restart_run_id = restart_run_id
        self.restarts = restarts  # the run's restarts so far (its start time, the summary's restarts line)
        self._said_empty = False  # a step with every group left out was said (`log`)
        # steps this process logged, and those of them whose every group was left out (`log`; the summary says when
        # it was all of them: nothing trained, no reward, rather than a bare "final reward nan")
        self.logged_steps: list[int] = []
        self.left_out_steps = 0
        # steps that kept groups but none of whose responses entered the loss: every kept one ended by length and
        # algorithm.mask_truncated left it out (`log`); they trained nothing either
        self.masked_steps = 0
        self._said_masked = False
        self.resume = checkpoints.resume if checkpoints is not None else None
        self.start_step = self.resume.step if self.resume is not None else 0
        self.rewards: list[float] = []
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, metrics) as logged by this process
        # a reopened run's eval/* values up to the resumed step, from the store (the closing summary's eval line)
        self.earlier_evals: dict[str, list[tuple[int, float]]] = {}
        self.eval_set_order: list[str] = []  # the eval sets in evaluation order (log_datasets)
        self.steps = self.start_step
        self.evaluated_only = False  # log_evaluation: a run that trained no step, only evaluated
        self.eval_sample_files: list[Path] = []  # log_evaluation: the eval samples written (train.eval_save_samples)
        # checkpoints not written so far in this run (train.save_failures=continue), carried across resumes
        failures = self.resume.state.get(FAILURES_STATE) if self.resume is not None else 0
        self.checkpoint_failures = failures if type(failures) is int else 0
        self.ledger = Ledger()
        self._ledger_missing = False  # the resumed checkpoint predates ledgers
        if self.resume is not None:
            try:
                saved = read_checkpoint(self.resume.path, self.resume.state)
            except LedgerError as exc:
                raise RunError(f"checkpoint {self.resume.path} cannot be resumed: {exc}") from None
            self._ledger_missing = saved is None
            if saved is not None:
                self.ledger = saved.truncate(self.start_step)
        self._ledger_resumed = len(self.ledger)  # entries of the checkpoint resumed (this job's come after)
        self._reopened = False
        self._ledger_logged: int | None = None  # entries in the MLflow artifact (None: not written by this job)
        # the checkpoint of the last step (train.save_hf exports it): committed by save_checkpoint, or resumed from
        self.final_checkpoint: Path | None = None
        if self.resume is not None and self.resume.step >= cfg.train.num_rollout:
            self.final_checkpoint = self.resume.path
        self.hf_dir: Path | None = None  # where train.save_hf exported it
        self.model_uri: str | None = None  # the MLflow model of tracking.log_model
        if checkpoints is not None:
            checkpoints.attachments[LEDGER_FILE] = lambda step: self.ledger.before(step).dumps()

    def __enter__(self) -> Session:

        from relax.runner.summary import config_summary
        from relax.tracking.mlflow_run import (
            CHECKPOINT_DIR_TAG,
            RESUMED_TAG,
            NullTracker,
            RunOptions,
            Tracker,
            TrackingUnavailable,
            close_orphan_run,
            resolve_tracking_uri,
        )
        from relax.tracking.params import TAG_OVERRIDES, flatten_config, overrides_text, standard_tags
        from relax.tracking.progress import Progress

        cfg = self.cfg
        # the run's wall time counts from its start (time.monotonic), across restarts of the service graph
        self.t0 = self.restarts.started if self.restarts is not None else time.monotonic()
        print(config_summary(cfg), file=sys.stderr)
        print(self.plan.render(), file=sys.stderr)
        resume = self.resume
        reopen_id = resume.run_id if resume is not None else self.restart_run_id
        reopen = cfg.tracking.enabled and reopen_id is not None
        if cfg.tracking.enabled:
            flush_s = flush_interval_s()
            spool_dir = self.spool_dir()
            # MLflow's system metrics of this machine, sampled until the run ends (relax.tracking.system_metrics)
            system_s = cfg.tracking.system_metrics_interval_s if cfg.tracking.system_metrics else None
            options = RunOptions(flush_interval_s=flush_s, spool_dir=spool_dir, system_metrics_s=system_s)
            tags = standard_tags(cfg)
            if self.checkpoints is not None and self.checkpoints.uses_dir:  # where relax-verify-run finds them
                tags[CHECKPOINT_DIR_TAG] = str(self.checkpoints.save_dir)
            overrides = _hydra_overrides()
            if overrides and not reopen:  # a reopened run keeps the overrides it was started with
                tags[TAG_OVERRIDES] = overrides_text(overrides)
            if not reopen:  # a reopened run's is decided from what it holds (`_eval_step_tag`)
                tags[EVAL_STEP_TAG] = EVAL_STEP_WEIGHTS
            if reopen:
                tags[RESUMED_TAG] = resume_text(resume) if resume is not None else \
                    "no checkpoint (a restart from the first step)"
                self._reopened = True
                try:
                    self.tracker = Tracker.reopen(cfg.tracking, reopen_id, options, from_step=self.start_step,
                                                  tags=tags, keep_history=(RAW_REWARD, EVAL_PREFIX),
                                                  parent_run_id=cfg.tracking.parent_run_id)
                except (LookupError, TrackingUnavailable) as exc:
                    what = f"checkpoint {resume.path}" if resume is not None else f"MLflow run {reopen_id}"
                    hint = ""
                    recorded = resume.tracking_uri if resume is not None else None
                    if isinstance(exc, LookupError) and recorded and recorded != resolve_tracking_uri(cfg.tracking.uri):
                        hint = f"; the checkpoint's run was recorded in {recorded}: run with tracking.uri={recorded}"
                    raise RunError(f"cannot continue {what}: {exc}{hint}") from None
                # every continuation stays readable: relax.resumed.<n> beside relax.resumed (the last)
                self.tracker.set_tags(resume_history_tags(self.tracker.reopened_tags, tags[RESUMED_TAG]))
                counts = (resume.tracker_state.get("nonfinite_counts") or {}) if resume is not None else {}
                self.tracker.nonfinite_counts.update({k: int(v) for k, v in counts.items()})
                # the rewards of the steps before the resumed one (those from it on are recomputed); the
                # evaluations up to it: the one at the resumed step evaluated the resumed weights (log_evaluation)
                self.rewards = [v for s, v in self.tracker.recorded_history.get(RAW_REWARD, []) if s < self.start_step]
                evals = {k: v for k, v in self.tracker.recorded_history.items() if k.startswith(EVAL_PREFIX)}
                self._eval_step_tag(evals)
                self.earlier_evals = {k: kept for k, v in evals.items()
                                      if (kept := [(s, x) for s, x in v if s <= self.start_step])}
            else:
                try:
                    self.tracker = Tracker.start(cfg.tracking, options, run_name=cfg.tracking.run_name, tags=tags,
                                                 params=flatten_config(cfg), parent_run_id=cfg.tracking.parent_run_id)
                except BaseException as exc:
                    # the run never started: an earlier run's checkpoints that this fresh one set aside go back
                    if self.checkpoints is not None:
                        self.checkpoints.put_back_earlier_runs()
                    if isinstance(exc, TrackingUnavailable):  # before training: a wrong URI is the user's to fix
                        raise RunError(str(exc)) from None
                    raise
        else:
            self.tracker = NullTracker()
        self.tracker.__enter__()
        if self.checkpoints is not None and cfg.tracking.enabled:
            previous = self.checkpoints.previous_run_id
            if previous and previous != self.tracker.run_id:
                # the last job in this directory holds no lock any more: it is gone; if it was killed before its
                # first checkpoint (nothing to resume), its run would stay RUNNING forever. It is closed in its own
                # store (run.json records it), which need not be this run's: train.save_dir's default is shared by
                # the runs of every tracking.uri
                closed_in = close_orphan_run(self.tracker, previous, self.checkpoints.previous_run_uri)
                if closed_in is not None:
                    where = "" if closed_in == self.tracker.uri else f" (in MLflow store {closed_in})"
                    print(f"MLflow run {previous}{where} of the last job in {self.checkpoints.save_dir} was still "
                          "RUNNING (that job was killed); marked KILLED", file=sys.stderr, flush=True)
            self.checkpoints.record_run(self.tracker.run_id, self.tracker.uri)
        resolved = config_yaml(cfg) if self.checkpoints is None else self.checkpoints.config_yaml
        if not reopen:  # a reopened run keeps the config and plan it started with (they are the same but for
            self.tracker.log_text(resolved, "config.yaml")  # the fields in the relax.resumed tag)
            self.tracker.log_text(self.plan.render() + "\n", "plan.txt")
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.resolved.yaml").write_text(resolved)
        if resume is not None:
            print(f"resuming from {resume.path} ({resume.step} steps trained)", file=sys.stderr, flush=True)
            if self._ledger_missing and resume.step > 0:
                print(f"relax-train: note: checkpoint {resume.path} has no {LEDGER_FILE} (written before sample "
                      f"ledgers): the run's ledger starts after step {resume.step}, so relax-verify-run reports "
                      f"{steps_name(range(resume.step))} as missing from it", file=sys.stderr, flush=True)
        self.progress = Progress(cfg.train.num_rollout, enabled=cfg.tracking.progress, start_step=self.start_step,
                                 started=self.t0)
        return self

    @property
    def run_id(self) -> str | None:
        """The MLflow run (None when tracking is off)."""
        return getattr(self.tracker, "run_id", None)

    def spool_dir(self) -> Path:
        """Where the MLflow writes of an outage are spooled: the (locked) checkpoint directory, found again by a
        resume, else the job's output directory."""
        if self.checkpoints is not None and self.checkpoints.uses_dir:
            return self.checkpoints.save_dir
        return self.output_dir

    def note(self, message: str) -> None:
        self.progress.write(message)

    def log(self, metrics: dict[str, float], step: int, *, kept: bool = True, trained: bool = True) -> None:
        """The metrics of training step `step` (0-based). `kept=False`: every group of the step was left out (its
        reward calls or episodes failed), so the means over its kept responses (rollout/raw_reward, ...) have no
        value, NaN: those are not sent to MLflow, whose tracker would warn of each as of a run gone wrong (and count
        it in relax.nonfinite_metrics); the first such step says so once, with the keys. `trained=False` (groups
        kept): no response entered the loss, every kept one ended by length and algorithm.mask_truncated left it
        out; the first such step says so once."""
        logged = metrics
        self.logged_steps.append(step)
        self.left_out_steps += not kept
        masked = kept and not trained
        self.masked_steps += masked
        if masked and not self._said_masked:
            self._said_masked = True
            self.note(f"{step_name(step)}: every kept response ended by length, and algorithm.mask_truncated leaves "
                      "those out of the loss: the step trained nothing (rollout/truncated_masked_frac plus "
                      "rollout/reward_dropped_frac is 1.0 at such a step; said once); raise rollout.max_response_len, "
                      "or set algorithm.mask_truncated=false")
        if kept and trained and self.restarts is not None:
            self.restarts.trained.add(step)
        if not kept:
            empty = [k for k, v in metrics.items() if math.isnan(float(v))]
            logged = {k: v for k, v in metrics.items() if k not in empty}
            if empty and not self._said_empty:
                self._said_empty = True
                self.note(f"{step_name(step)}: every group was left out (the warnings above say why), so "
                          f"{', '.join(empty)} {'has' if len(empty) == 1 else 'have'} no value: not logged at such "
                          "a step (rollout/reward_dropped_frac 1.0 marks it; said once)")
        self.tracker.log_metrics(logged, step)
        self._add_history(step, metrics)
        if math.isfinite(metrics.get(RAW_REWARD, math.nan)):  # NaN: every response of the step was left out
            self.rewards.append(metrics[RAW_REWARD])
        self.steps = step + 1
        self.progress.update(step + 1, metrics, left_out=not kept)

    def log_evaluation(self, metrics: dict[str, float], trained_steps: int, *, evaluation_only: bool = False,
                       samples: Mapping[str, list[dict]] | None = None) -> None:
        """The eval/* metrics of an evaluation of the weights `trained_steps` training steps produced (0: the initial
        weights), logged at step `trained_steps` and kept for the summary, without counting as a trained step
        (rewards, steps, progress). `evaluation_only`: the one evaluation of a run that trains no step
        (`Recipe.evaluate_only`). `samples`: each eval set's sample records (`train.eval_save_samples`), written as
        eval/<set>/step_<k>.jsonl in the output directory and among the MLflow run's artifacts."""
        # The one place that decides the step of an evaluation: the number of training steps in the weights it
        # evaluated, which names them unambiguously (checkpoint step_<k> holds the weights of k steps; the initial
        # weights are 0). So the evaluation after 0-based training step s is logged at s + 1, beside the next step's
        # rollout/* (in sync mode sampled from these very weights), the final one at train.num_rollout, and an
        # evaluation-only run of checkpoint k lands on the step where the training run logged the same weights',
        # never on another's (verl steps its validation the same way: before training at 0, after step n at n).
        # Runs made before logged the training-time evaluation at s, one less: EVAL_STEP_TAG tells them apart.
        step = trained_steps
        logged = metrics
        held_sets: set[str] = set()
        if evaluation_only:
            # a reopened run keeps the first value of each (key, step) it holds (Tracker.reopen): where it holds an
            # earlier evaluation of an eval set at this step (of these weights), none of this evaluation of that set
            # is recorded, neither the keys it shares with the earlier one nor its new ones (pass@4 of a sampled
            # evaluation beside pass@1 of a greedy one would be a mix of two evaluations at one step): a set is
            # recorded whole or not at all; its samples go to the output directory only. Its values are shown in the
            # summary (history)
            held = sorted(set(metrics) & getattr(self.tracker, "_recorded", {}).get(step, set()))
            held_sets = {_eval_set_of(key) for key in held}
            logged = {k: v for k, v in metrics.items() if _eval_set_of(k) not in held_sets}
            if held:
                ckpt = self.resume.path if self.resume is not None else "<checkpoint>"
                left = len(metrics) - len(logged)
                names = ", ".join(sorted(held_sets))
                kept_local = ", its samples are in the output directory only" if held_sets & set(samples or ()) else ""
                self.progress.write(
                    f"relax-train: warning: MLflow run {self.run_id} already holds an earlier evaluation of "
                    f"these weights at step {step} for eval set(s) {names} ({len(held)} of this evaluation's "
                    f"metrics: {held[0]}, ...); MLflow keeps the first value of a step, so none of this "
                    f"evaluation's {left} metric(s) of {names} is recorded (its values are shown in the summary "
                    f"only{kept_local}) and the earlier values stay. To record "
                    f"them, evaluate the policy in a new run: `relax-export {ckpt} <dir>`, then `relax-train "
                    "model.source=hf model.path=<dir> train.num_rollout=0 ...`")
            self.evaluated_only = True
        self.tracker.log_metrics(logged, step)
        self._add_history(step, metrics)
        for eval_set, records in (samples or {}).items():
            relative = eval_samples_file(eval_set, step)
            text = to_jsonl(records)
            local = self.output_dir / relative
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(text, encoding="utf-8")
            if eval_set not in held_sets:
                self.tracker.log_text(text, relative)
            self.eval_sample_files.append(local)

    def _add_history(self, step: int, metrics: dict[str, float]) -> None:
        """`history` holds one entry per step, as the MLflow run does: an evaluation logged at the step the next
        training step then logs (or the reverse) shares its entry."""
        if self.history and self.history[-1][0] == step:
            self.history[-1][1].update(metrics)
        else:
            self.history.append((step, dict(metrics)))

    def _eval_step_tag(self, evals: Mapping[str, list[tuple[int, float]]]) -> None:
        """EVAL_STEP_TAG on a reopened run (`evals`: the eval/* values it holds): a run started before the tag
        existed that holds evaluations logged them at the step before the weights' (after 0-based step s, at s); this
        job logs its own at the weights' step. MLflow values cannot be moved, so the run is continued with both, the
        tag saying from which step the weights' step holds, and a warning."""
        held = getattr(self.tracker, "reopened_tags", {}).get(EVAL_STEP_TAG)
        if held is not None:
            return
        if not evals:  # nothing logged the old way: the run is as one started now
            self.tracker.set_tags({EVAL_STEP_TAG: EVAL_STEP_WEIGHTS})
            return
        k = self.start_step
        self.tracker.set_tags({EVAL_STEP_TAG: f"{EVAL_STEP_WEIGHTS} from step {k} (before: one less)"})
        print(f"relax-train: warning: MLflow run {self.tracker.run_id} was started by an older Relax, which logged "
              f"the evaluation after 0-based step s at step s; from step {k} on, this job logs it at s + 1, the number "
              "of training steps in the weights evaluated (checkpoint step_<s+1>; docs/training.md, \"Evaluation\"): "
              f"this run's eval/* values before step {k} sit one step early (tag {EVAL_STEP_TAG})",
              file=sys.stderr, flush=True)

    def record_samples(self, step: int, sample_ids, kept, set_aside=None) -> None:
        """Add step `step` to the sample ledger: its rollout's `sample_ids` ([N] LongTensor, unique over the run),
        `kept` ([N] bool: the samples it trained; the others were left out with their group) and `set_aside` (ids
        generated for it that dynamic sampling left out of its batch; None: none)."""
        if sample_ids is None:
            raise RunError(f"{step_name(step)}: the rollout's samples carry no sample ids, so the ledger cannot record "
                           "them")
        self.ledger.add(step, sample_ids, kept, set_aside)

    def log_datasets(self, train_set: PromptDataset, eval_sets: Mapping[str, PromptDataset] | None = None) -> None:
        """Record the run's prompt sets as MLflow dataset inputs (`relax.tracking.inputs`): `train_set` under
        `data.name` (context train), each of `eval_sets` under its eval set name, that of its `eval/<name>/...` metrics
        (context eval). A reopened run logs them again, which adds nothing unless the prompts changed. A failure is
        noted, never raised (a store outage spools them like any other write)."""
        self.eval_set_order = list(eval_sets or {})
        if not self.cfg.tracking.enabled:
            return
        try:
            self.tracker.log_inputs(dataset_records(self.cfg, train_set, eval_sets))
        except Exception as exc:
            self.note(f"the datasets could not be recorded in MLflow ({type(exc).__name__}: {exc}); training goes on")

    def log_ledger(self) -> None:
        """Write this job's whole ledger to the MLflow run (artifact `ledger.jsonl`) if it changed since the last
        write; a failure is noted, never raised (training goes on; a store outage spools it like any other write). A
        reopened run is not written by a job that recorded no step (an evaluation of a checkpoint, an older one
        included, or a resume that stopped before its first step): the ledger of the steps it trained stays."""
        if self._reopened and len(self.ledger) == self._ledger_resumed:
            return
        ledger = self.ledger
        if self._ledger_logged == len(ledger):
            return
        try:
            self.tracker.log_text(ledger.dumps(), LEDGER_FILE)
        except Exception as exc:
            self.note(f"the sample ledger could not be written to MLflow ({exc}); it is in the next checkpoint")
            return
        self._ledger_logged = len(ledger)

    def save_checkpoint(self, cluster, step: int, state: dict, rollout: dict | None = None) -> Path | None:
        """Flush the metrics of every step so far, then write and commit the checkpoint of `step`.

        Flushed means in the store, or, while the store is unavailable, in the run's spool on disk (replayed by
        this run later, or by the job that resumes from this checkpoint). If neither takes them, no checkpoint is
        committed (it would cover steps whose metrics a kill could still lose): a note says so and training goes
        on; the next checkpoint tries again. A write that fails at the OS level (disk full, read-only...) is
        `train.save_failures`'s (see `_not_written`); any other error is raised as it is.
        """
        try:
            self.tracker.flush()
        except Exception as exc:
            self.note(f"checkpoint at step {step} not written: the metrics it covers are not in MLflow yet ({exc})")
            return None
        self.log_ledger()  # before the commit: the checkpoint's ledger (Checkpoints.attachments) is a prefix of it
        state = {**state, "mlflow_run_id": self.tracker.run_id, TRACKING_URI_STATE: self.tracker.uri,
                 "tracker": {"nonfinite_counts": dict(self.tracker.nonfinite_counts)},
                 FAILURES_STATE: self.checkpoint_failures}
        try:
            path = cluster.save(self.checkpoints, step, state, rollout)
        except Exception as exc:  # a role's write (on Ray: the cause of a RayTaskError) or the driver's
            error = os_write_error(exc)
            if error is None:
                raise
        else:
            if step >= self.cfg.train.num_rollout:
                self.final_checkpoint = path
            return path
        self._not_written(step, error)
        return None

    def _not_written(self, step: int, error: OSError) -> None:
        """The checkpoint of `step` failed to write at the OS level (disk full, quota, read-only, permissions, I/O
        error): its staging directory is removed (committed checkpoints are never touched), then the run stops with
        a RunError (`train.save_failures=stop`) or notes it, counts it in `fault/checkpoint_failures` (logged at the
        step whose checkpoint failed) and goes on (`continue`: the next checkpoint tries again)."""
        import errno

        from relax.metrics import FAULT_CHECKPOINT_FAILURES
        from relax.runner.checkpoint import latest, step_dir

        ckpts = self.checkpoints
        code = errno.errorcode.get(error.errno, str(error.errno))
        text = f"{error.strerror} ({code})" + (f": {error.filename}" if error.filename else "")
        what = f"step {step}: checkpoint {step_dir(ckpts.save_dir, step).name} could not be written: {text}"
        if not ckpts.discard(step):
            what += f" (its partial files in {ckpts.staging_path(step)} could not be removed either)"
        kept = latest(ckpts.save_dir)
        if self.cfg.train.save_failures == "stop":
            intact = f"the latest committed checkpoint, {kept}, stays valid" if kept is not None else \
                "no checkpoint was committed before it"
            then = "to continue from it" if kept is not None else "(it starts from the first step without a checkpoint)"
            raise RunError(f"{what}. The run stops (train.save_failures=stop); {intact}. Once {ckpts.save_dir} has "
                           f"space and is writable again, run with train.resume=auto {then}.")
        self.checkpoint_failures += 1
        self.tracker.log_metrics({FAULT_CHECKPOINT_FAILURES: float(self.checkpoint_failures)}, step - 1)
        if self.history and self.history[-1][0] == step - 1:
            self.history[-1][1][FAULT_CHECKPOINT_FAILURES] = float(self.checkpoint_failures)
        message = (f"relax-train: warning: {what}; training goes on (train.save_failures=continue), the next "
                   f"checkpoint tries again; latest committed checkpoint: {kept or 'none'}")
        self.progress.write(message)

    def export_final(self) -> None:
        """train.save_hf=true: the final checkpoint as a Hugging Face directory, `<save_dir>/hf` (replaced if there),
        then, with tracking.log_model=true, that directory as an MLflow model of the run (see the class docstring).
        RunError when the final checkpoint was not written or the export or the log fails."""
        cfg = self.cfg
        if not cfg.train.save_hf or self.checkpoints is None:
            return
        # imported only when exporting: relax.runner.export imports transformers' model classes
        from relax.runner.checkpoint import latest
        from relax.runner.export import RUN_EXPORT_DIR, ExportRefused, export_checkpoint
        from relax.tracking.model import HF_DIR_TAG

        out = self.checkpoints.save_dir / RUN_EXPORT_DIR
        ckpt = self.final_checkpoint
        if ckpt is None:  # its write failed (train.save_failures=continue)
            kept = latest(self.checkpoints.save_dir)
            then = (f"the latest committed checkpoint is {kept} (of an earlier step; `relax-export {kept} {out} "
                    "--force` exports it)" if kept is not None else "no checkpoint was committed")
            raise RunError(f"train.save_hf=true: the checkpoint of the final step ({cfg.train.num_rollout}) was not "
                           f"written, so the final policy could not be exported to {out}; {then}")
        try:
            result = export_checkpoint(ckpt, out, force=True)
        except (ExportRefused, OSError) as exc:
            raise RunError(f"train.save_hf=true: exporting the final checkpoint {ckpt} to {out} failed: {exc}. The "
                           f"checkpoint is committed and unchanged; export it again with `relax-export {ckpt} {out} "
                           "--force`") from None
        self.hf_dir = out
        self.tracker.set_tags({HF_DIR_TAG: str(out)})
        self.progress.write(f"final policy (step {result.step}, {ckpt.name}) exported as a Hugging Face model to {out}")
        if cfg.tracking.log_model:
            self._log_model(result.out_dir, result.step, result.checkpoint)

    def _log_model(self, hf_dir: Path, step: int, ckpt: Path) -> None:
        from relax.tracking.model import MODEL_URI_TAG, log_hf_model, logged_model_of_step, retry_command

        run_id = self.tracker.run_id
        if self.resume is not None:  # a reopened run may hold the model of this step already (resumed at its end)
            existing = logged_model_of_step(self.tracker.client, run_id, step)
            if existing is not None:
                self.model_uri = existing
                self.progress.write(f"MLflow run {run_id} already holds the model of step {step}, {existing}: "
                                    "not logged again")
                return
        try:
            self.model_uri = log_hf_model(self.tracker.client, run_id, hf_dir, step=step, checkpoint=str(ckpt))
        except Exception as exc:
            detail = (str(exc).strip().splitlines() or [""])[0]
            raise RunError(f"tracking.log_model=true: the final policy, exported to {hf_dir}, could not be logged "
                           f"into MLflow run {run_id} as a model ({type(exc).__name__}: {detail}). Once the store "
                           f"takes it, log it with `{retry_command(hf_dir, run_id, self.tracker.uri)}`") from None
        self.tracker.set_tags({MODEL_URI_TAG: self.model_uri})
        self.progress.write(f"logged into MLflow run {run_id} as the model {self.model_uri} (mlflow.transformers)")

    def summary_history(self) -> list[tuple[int, dict[str, float]]]:
        """The history the closing summary reads its eval line from: this process's, after the evaluations a reopened
        run holds from before its resumed step (so that a resumed run, one resumed at its end included, shows the
        last evaluation as the uninterrupted run would). Those come from the store in name order: each step's keys
        are put back in the order the run logs them (eval sets in evaluation order, then mean@n, pass@k by k)."""
        if not self.earlier_evals:
            return self.history
        by_step: dict[int, dict[str, float]] = {}
        for key, values in self.earlier_evals.items():
            for step, value in values:
                by_step.setdefault(step, {})[key] = value
        order = {name: i for i, name in enumerate(self.eval_set_order)}

        def logged_order(key: str) -> tuple:
            eval_set, _, metric = key[len(EVAL_PREFIX):].rpartition("/")
            kind, _, number = metric.rpartition("_")
            return (order.get(eval_set, len(order)), eval_set, kind != EVAL_MEAN_AT.rstrip("_"),
                    int(number) if number.isdigit() else 0, metric)

        earlier = [(step, {k: metrics[k] for k in sorted(metrics, key=logged_order)})
                   for step, metrics in sorted(by_step.items())]
        return earlier + self.history

    def finish(self) -> RunResult:
        """Flush tracking, write the ledger, export the final policy (train.save_hf) and print the summary (final =
        mean reward of the last 10 steps). A job in which no step trained (`_nothing_trained`; an evaluation-only one
        aside) then fails: NothingTrained, its message the summary's title, so that relax-train exits 1 and a sweep
        counts the job FAILED (a run of data.max_failed_reward_steps such steps stops before, with a RunError)."""
        self.tracker.flush()
        self.log_ledger()
        self.export_final()
        k = min(10, len(self.rewards)) or 1
        final = sum(self.rewards[-k:]) / k if self.rewards else float("nan")
        first = sum(self.rewards[:k]) / k if self.rewards else float("nan")
        best = max(self.rewards) if self.rewards else float("nan")
        first_label = f"first {k} step{'s' if k > 1 else ''} reward"  # 10, or all of a shorter run
        extra = {first_label: first, "steps": self.steps,
                 "wall time": f"{time.monotonic() - self.t0:.0f} s", "outputs": str(self.output_dir)}
        if self.restarts is not None and (restarted := self.restarts.summary()) is not None:
            extra["restarts"] = restarted
        if self.checkpoint_failures:  # train.save_failures=continue
            extra["checkpoints not written"] = self.checkpoint_failures
        if self.hf_dir is not None:
            extra["HF model"] = str(self.hf_dir)
        if self.model_uri is not None:
            extra["MLflow model"] = self.model_uri
        title = "Relax run finished"
        if self.evaluated_only:  # nothing trained in this job: say what was evaluated
            title = "Relax run finished (evaluation only: nothing trained)"
            m = self.cfg.model
            weights = (f"the checkpoint of step {self.start_step}, {self.resume.path}" if self.resume is not None
                       else f"the initial weights of model {m.name} (built from config, seed {self.cfg.seed})"
                       if m.source == "config" else f"the weights of model {m.path or m.name} ({m.source})")
            extra = {"evaluated": weights, **extra}
            if not self.rewards:  # no training reward exists (a fresh evaluation-only run): none is shown
                del extra[first_label]
        show_rewards = bool(self.rewards) or not self.evaluated_only
        failed = None  # a job that trained nothing: its one-line error
        if (not self.evaluated_only and self.logged_steps
                and self.left_out_steps + self.masked_steps == len(self.logged_steps)):
            title, extra, error = self._nothing_trained(extra)
            if self.restarts is None or not self.restarts.trained:  # (else the weights hold an earlier attempt's)
                failed = error
            show_rewards = bool(self.rewards)  # a resumed run's earlier steps' rewards, else none: no "nan"
            if not self.rewards:
                del extra[first_label]
        extra.update(final_eval_summary(self.summary_history()))
        if self.eval_sample_files:  # train.eval_save_samples: where the evaluations' samples are
            n = len(self.eval_sample_files)
            extra["eval samples"] = (f"{self.output_dir}/eval/<set>/step_<k>.jsonl ({n} file{'s' if n > 1 else ''}"
                                     + (", also among the MLflow run's artifacts)" if self.run_id else ")"))
        self.progress.summary(final, best, getattr(self.tracker, "run_id", None), self.tracker.ui_command(), extra,
                              title=title, rewards=show_rewards)
        result = RunResult(getattr(self.tracker, "run_id", None), self.history, first, final, best)
        if failed is not None:
            raise NothingTrained(failed, result)
        return result

    def _nothing_trained(self, extra: dict[str, object]) -> tuple[str, dict[str, object], str]:
        """The summary's title and rows of a run whose every step (of this process) left every group out: its reward
        calls or episodes failed (a run of data.max_failed_reward_steps such steps stops before; a shorter one ends
        here), or kept groups whose every response ended by length and algorithm.mask_truncated left out of the
        loss; so no step of this job trained and it has no reward of its own to show; and the job's one-line error
        (`finish`), the title's words with the steps and why. A resumed run's earlier steps (those of the checkpoint
        it started from) did train, so its title says so rather than "nothing trained": the checkpoint and the
        exported model hold their weights."""
        first, last = self.logged_steps[0] + 1, self.logged_steps[-1] + 1
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        limit = self.cfg.data.max_failed_reward_steps
        stops = f"; data.max_failed_reward_steps={limit} in a row stop a run" if limit and self.left_out_steps else ""
        why = "their reward calls or episodes failed"
        lost = "every group"
        if self.masked_steps:  # (some) steps kept groups whose every response algorithm.mask_truncated left out
            lost = "every response"
            cut = ("every kept response ended by length, which algorithm.mask_truncated leaves out of the loss (raise "
                   "rollout.max_response_len, or set algorithm.mask_truncated=false)")
            why = cut if not self.left_out_steps else f"their reward calls or episodes failed, or {cut}"
        said = ("the warnings above name each step's first failure" if self.left_out_steps else
                "a note above says so at the first such step")
        left = {"left out": f"{lost} of {steps}: {why} ({said}){stops}"}
        if self.restarts is not None and self.restarts.trained:  # the job trained: `finish` does not fail it
            earlier = len(self.restarts.trained)
            what = (f"no step of this attempt trained: {lost} of {steps} was left out; {earlier} step(s) of an "
                    "earlier attempt of the job trained, whose weights it resumed")
            return f"Relax run finished ({what})", {**left, **extra}, f"{what} ({why})"
        if self.start_step == 0:
            what = f"nothing trained: {lost} of every step was left out"
            return (f"Relax run finished ({what})", {**left, **extra},
                    f"{what} ({steps}: {why}; {said})")
        before = "step 1" if self.start_step == 1 else f"steps 1-{self.start_step}"
        what = f"no step of this job trained: {lost} of {steps} was left out; {before} trained before the resume"
        return (f"Relax run finished ({what})", {**left, **extra},
                f"{what} ({why}; {said})")

    def __exit__(self, exc_type, exc, tb) -> None:
        self.log_ledger()  # a run that stops or fails: the steps it trained since its last checkpoint
        self.progress.close()
        self.tracker.__exit__(exc_type, exc, tb)
