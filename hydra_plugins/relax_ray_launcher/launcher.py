"""A Hydra `Launcher` that runs the jobs of a multirun concurrently as Ray tasks.

Why our own: hydra-ray-launcher pins cloudpickle<3 and an old Ray API, stops at the first failed job
and knows nothing of MLflow. This one, per sweep:
1. composes every job's config and runs `precheck` on each (Relax: validation and the checks a single run makes
   before Ray, `check_sweep_job`), and refuses jobs that share what each needs to itself (the checkpoint
   directory), reporting all invalid jobs at once (exit 2) before anything starts;
2. creates the MLflow parent run (and so the sqlite store: jobs never race to create its schema) and
   adds `tracking.parent_run_id`, `tracking.sweep_id` and `tracking.arm` to each job's overrides;
3. runs each job with Hydra's `run_job` in its own Ray worker process (`max_calls=1`), at most
   `max_concurrent_jobs` at a time, on the Ray cluster joined (`hydra.launcher.address`, `cluster.address`, else
   `RAY_ADDRESS`), or else on a Ray instance of the sweep's own (`ray.init(address="local")`, as a single run: never
   one that a stale /tmp/ray/ray_current_cluster or a user's `ray start --head` names); a failing job is
   recorded and the others go on; each job's MLflow run is tagged `relax.sweep_job` (`<sweep id>/<job index>`),
   so that the table names each job's own run;
4. prints a table of jobs and ends the parent run FINISHED, or FAILED if any job failed (exit 1); a job's run that
   its process left RUNNING (killed, or crashed: kill -9, out of memory) is ended with the job's status in the table.
   A job that never started (queued behind others at Ctrl-C, or Ray could not be started or joined) is NOT STARTED;
   the parent run's `relax.sweep_jobs` tag holds each job's status.

A cluster to join (`hydra.launcher.address`, `cluster.address`, RAY_ADDRESS) that does not accept a TCP connection
is refused before anything else, within seconds (`relax.runner.endpoints`): `relax-train: error: cannot join Ray:
hydra.launcher.address=...: connection to ... refused (...)`, exit 2, no parent run. Any other Ray that cannot be
started or joined is one line, `relax-train: error: cannot start or join Ray ...`, exit 2, after
the table (every job NOT STARTED; the parent run FAILED).

A tracking store that cannot be opened is refused before any job starts (the precheck's `tracking`, and the parent
run's start), with relax-train's one-line error and exit 2.

Ctrl-C stops the running jobs as Ctrl-C stops a single run (`relax.runner.preempt`): each job gets the interrupt
(`ray.cancel` without force, a KeyboardInterrupt raised by Ray through the job's SIGINT handler), finishes its step,
writes its checkpoint and marks its run KILLED; after `stop_timeout_s`, or a second Ctrl-C, the rest are killed. The
parent run ends KILLED and relax-train exits 130. SIGTERM to the driver does the same, and relax-train exits 143.
"""


import importlib
import inspect
import json
import logging
import math
import os
import re
import signal
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.relax_ray_launcher.sweep import (
    JobRow,
    derive_arms,
    format_table,
    new_sweep_id,
    tracking_overrides,
)
from relax.config.credentials import masked_override
from relax.metrics import RAW_REWARD
from relax.runner.preempt import Signalled
from relax.runner.ray_logs import plain_ray_log_prefix

log = logging.getLogger(__name__)
INVALID_CONFIG_EXIT = 2  # as relax-train's single-run validation
REWARD_METRIC = RAW_REWARD
FINAL_REWARD_STEPS = 10  # the table's final reward: the mean of the last 10 steps, as relax-train's summary
JOB_TAG = "relax.sweep_job"  # on each job's MLflow run: "<sweep id>/<job index>", how the table finds it
JOBS_TAG = "relax.sweep_jobs"  # on the parent run: each job's status in the table, {"0": "FINISHED", "1": ...}
NOT_STARTED = "NOT STARTED"  # a job that never ran: no process, no MLflow run
# the marks a job writes: first on its stdout (`begin`), last on its stdout and its stderr (`end`, also when it stops
# at the sweep's Ctrl-C), with its index. The driver, which Ray forwards the jobs' output to (log_to_driver), waits to
# see the end of each job that returned, or stopped once it had begun, before it leaves Ray (ray.shutdown drops what
# Ray's log monitor has not yet forwarded), and keeps the marks from the output it prints
OUTPUT_MARK = "relax-sweep-job-output"
OUTPUT_END_WAIT_S = 30.0  # at most, for jobs whose last lines never come (a node lost after the job returned)
_MARK = re.compile(rf"{OUTPUT_MARK} (\d+) (begin|end)")


def _mark(index: int, what: str) -> str:
    return f"{OUTPUT_MARK} {index} {what}"


class _OutputEnds:
    """The marks of the jobs' forwarded output (`OUTPUT_MARK`), seen by Ray's handler of the forwarded lines in the
    driver (`ray._private.worker.global_worker_stdstream_dispatcher`'s "ray_print_logs", there only with
    log_to_driver), which this wraps so that the marks are not printed. Ray's private names (Ray is pinned in
    constraints.txt; tests/experiments/test_sweep_output_ends.py runs them): where they differ, nothing is waited for
    and nothing is hidden."""

    NAME = "ray_print_logs"

    def __init__(self) -> None:
        self.seen: set[tuple[int, str, bool]] = set()  # (job index, begin | end, on stderr)
        self.changed = threading.Condition()
        self.printer: Optional[Callable[[dict[str, Any]], None]] = None

    @staticmethod
    def _dispatcher() -> Any:
        try:
            from ray._private.worker import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:
            return None
        return dispatcher if hasattr(dispatcher, "_lock") and hasattr(dispatcher, "handlers") else None

    def install(self) -> None:
        if (dispatcher := self._dispatcher()) is None:
            return
        with dispatcher._lock:  # in place: no forwarded line is handled by neither
            printers = [h for name, h in dispatcher.handlers if name == self.NAME]
            if len(printers) != 1 or self.printer is not None:  # log_to_driver=False: nothing is forwarded
                return
            self.printer = printers[0]
            dispatcher.handlers = [(n, self._handle if n == self.NAME else h) for n, h in dispatcher.handlers]

    def uninstall(self) -> None:
        """Ray's own handler back, where this one is still there (a Ray that goes on forwarding)."""
        if (dispatcher := self._dispatcher()) is None:
            return
        with dispatcher._lock:
            dispatcher.handlers = [(n, self.printer if h == self._handle else h) for n, h in dispatcher.handlers]
        self.printer = None

    def _handle(self, data: dict[str, Any]) -> None:
        lines = data.get("lines") or []
        if any(OUTPUT_MARK in line for line in lines):
            kept, err = [], bool(data.get("is_err"))
            with self.changed:
                for line in lines:
                    # a mark may follow a job's last text without a newline, which Ray forwards as one line
                    for m in _MARK.finditer(line):
                        self.seen.add((int(m.group(1)), m.group(2), err))
                    text = _MARK.sub("", line)
                    if text or OUTPUT_MARK not in line:
                        kept.append(text)
                self.changed.notify_all()
            if not kept:
                return
            data = {**data, "lines": kept}
        assert self.printer is not None
        self.printer(data)

    def wait(self, returned: Sequence[int], stopped: Sequence[int], timeout: float) -> list[int]:
        """The jobs whose output's end did not arrive within `timeout` seconds: of `returned`, each; of `stopped` (at
        the sweep's Ctrl-C), each that had begun (one cancelled before it ran writes nothing). At once where nothing
        is forwarded."""
        if self.printer is None:
            return []

        def missing() -> list[int]:
            begun = [i for i in stopped if (i, "begin", False) in self.seen]
            return [i for i in [*returned, *begun] if not {(i, "end", False), (i, "end", True)} <= self.seen]

        with self.changed:
            self.changed.wait_for(lambda: not missing(), timeout)
            return missing()


class RayUnavailable(Exception):
    """Ray could not be started or joined: no job started (relax-train's one-line error, exit 2)."""


@dataclass
class _Outcome:
    index: int
    ret: Optional[JobReturn]
    error: Optional[str]
    start: float
    end: float
    killed: bool = False  # stopped by the sweep's Ctrl-C


def job_key(sweep_id: str, index: int) -> str:
    """The `relax.sweep_job` tag of job `index`'s MLflow run."""
    return f"{sweep_id}/{index}"


def _error_text(exc: BaseException) -> str:
    """A job's failure for the table: the message of a user error, the traceback of anything else."""
    if type(exc).__name__ in ("JobError", "ConfigError", "RunError"):
        return str(exc)
    tb = exc.__traceback__
    while tb is not None and f"{os.sep}hydra{os.sep}" in tb.tb_frame.f_code.co_filename:
        tb = tb.tb_next  # Hydra's run_job: not the user's problem
    return "".join(traceback.format_exception(type(exc), exc, tb)).strip()


def _execute_job(index: int, overrides: Sequence[str], hydra_context: HydraContext, config: DictConfig,
                 task_function: TaskFunction, singleton_state: dict[Any, Any], cwd: str,
                 key: Optional[str] = None, ray_words: Optional[str] = None) -> _Outcome:
    """Body of one Ray task: one Hydra job, as Hydra's own launchers run it (fresh process, same cwd). `ray_words`:
    the sweep's Ray, as the job's plan says it (the job runs on that Ray: its own process is one of its workers)."""
    start = time.time()
    os.chdir(cwd)  # relative paths (outputs, sqlite store) mean the same as for the launcher
    if ray_words is not None:
        from relax.runner.plan import SWEEP_RAY_ENV

        os.environ[SWEEP_RAY_ENV] = ray_words
    if threading.current_thread() is threading.main_thread():
        # the sweep's Ctrl-C reaches the job as Ray's non-forced cancel, which raises KeyboardInterrupt through the
        # job's SIGINT handler; a worker started under an ignored SIGINT (a sweep run with nohup or `&` from a
        # script: Python then installs no handler) would never get it, and be killed at stop_timeout_s instead
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if key is not None:  # MLflow adds MLFLOW_RUN_CONTEXT's tags to every run it creates: here, the job's (one process)
        context = json.loads(os.environ.get("MLFLOW_RUN_CONTEXT") or "{}")
        os.environ["MLFLOW_RUN_CONTEXT"] = json.dumps({**context, JOB_TAG: key})
    setup_globals()
    Singleton.set_state(singleton_state)
    sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{index}"
        sweep_config.hydra.job.num = index
    HydraConfig.instance().set_config(sweep_config)
    print(_mark(index, "begin"), flush=True)  # (`_OutputEnds`)
    try:
        ret = run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    except KeyboardInterrupt as exc:  # the sweep's Ctrl-C (ray.cancel): relax.runner.preempt.Preempted says how
        if str(exc):  # the job stopped and where it continues from, as relax-train says it for a single run
            print(f"relax-train: {exc}", file=sys.stderr, flush=True)
        raise
    finally:  # the job's last lines, also those of a job stopped by the sweep's Ctrl-C (`_OutputEnds`)
        print(_mark(index, "end"), flush=True)
        print(_mark(index, "end"), file=sys.stderr, flush=True)
    error = None
    if ret.status == JobStatus.FAILED:
        error = _error_text(ret._return_value)
        ret._return_value = None  # exceptions may not pickle; the text travels instead
    return _Outcome(index, ret, error, start, time.time())


def _terminate_as_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM to the sweep's driver (a scheduler's stop): handled as Ctrl-C, so that the jobs stop with their
    checkpoints (Ray's own handler would abort the driver and leave them to be killed); relax-train then exits 143."""
    raise Signalled(signum)


def _result_field(value: Any, name: str) -> Any:
    """`name` of a job's return value: a dict key or an attribute (relax-train returns a RunResult)."""
    if isinstance(value, dict):
        return value.get(name)
    return getattr(value, name, None)


def _load_callable(path: str) -> Callable[[DictConfig], Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class RelaxRayLauncher(Launcher):
    def __init__(self, address: Optional[str] = None, max_concurrent_jobs: Optional[int] = None,
                 num_cpus: float = 1.0, num_gpus: Optional[float] = None,
                 precheck: Optional[str] = None, tracking: bool = True,
                 ray_init: Optional[dict[str, Any]] = None, stop_timeout_s: float = 120.0) -> None:
        self.address = address
        self.max_concurrent_jobs = max_concurrent_jobs
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.precheck = precheck
        self.tracking = tracking
        self.ray_init = dict(ray_init or {})
        self.stop_timeout_s = stop_timeout_s
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None
        self.sweep_id: Optional[str] = None
        self.parent = None  # relax.tracking.Tracker of the sweep's parent run
        self.started_ray = False  # this launcher called ray.init (and so shuts Ray down, or leaves the cluster)
        self.joined: Optional[str] = None  # the address of the cluster it joined; None: a Ray of its own
        self.output_ends = _OutputEnds()
        self.returned: list[int] = []  # the jobs whose task returned (and so wrote the end of its output)
        self.stopped: list[int] = []  # those the sweep's Ctrl-C stopped within stop_timeout_s (not killed)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    # ------------------------------------------------------------------ launch
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Run the batch; returns one JobReturn per job, in order. A failed job ends the sweep with exit 1 (after
        the table), Ctrl-C with KeyboardInterrupt, an invalid one before anything starts with exit 2."""
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        self._check_options()
        self._check_ray_address()
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        jobs = [list(o) for o in job_overrides]
        indices = [initial_job_idx + i for i in range(len(jobs))]
        dry = self._dry_run(jobs, indices)
        self.sweep_id = self.sweep_id or new_sweep_id()
        # the arms the real sweep tags its jobs with, in its dry run too: a job's arm names its default checkpoint
        # directory (<arm>-seed<seed>), so a dry run without them would check other directories than the sweep's
        would_track = self._tracking_enabled(dry_run=False)
        arms = self._arms(jobs) if would_track else [None] * len(jobs)
        tracked = not dry and would_track
        sweep_id = self.sweep_id if tracked else None
        self._precheck(jobs, arms, indices, sweep_id)
        if dry:
            return self._dry_run_all(jobs, arms, indices)
        parent_id = self._start_parent() if tracked else None
        full = [job + tracking_overrides(sweep_id=sweep_id, parent_run_id=parent_id, arm=arm)
                for job, arm in zip(jobs, arms, strict=True)]
        print(f"Sweep {self.sweep_id}: {len(jobs)} jobs" + (f", MLflow parent run {parent_id}" if parent_id else ""),
              flush=True)
        outcomes: dict[int, _Outcome] = {}
        started: set[int] = set()  # the jobs submitted to Ray (the others never started)
        status = "FAILED"
        unavailable: Optional[RayUnavailable] = None
        try:
            self._run_all(full, indices, jobs, outcomes, sweep_id, started)
            status = "FINISHED" if all(o.error is None for o in outcomes.values()) else "FAILED"
        except RayUnavailable as exc:
            unavailable = exc
        except KeyboardInterrupt as exc:
            status = "KILLED"
            # what relax-train's last line says stopped: the jobs on a cluster that keeps running, or a Ray of its own
            exc.joined = self.joined  # type: ignore[attr-defined]
            raise
        finally:
            self._stop_ray()  # also flushes the jobs' forwarded output, so the table comes last
            rows = self._rows(jobs, indices, outcomes, parent_id, started)
            print(format_table(rows, sweep_id=self.sweep_id, parent_run_id=parent_id), flush=True)
            if self.parent is not None:
                self._tag_statuses(rows)
                self.parent.finish(status)
        if unavailable is not None:
            print(f"relax-train: error: {unavailable}", file=sys.stderr, flush=True)
            sys.exit(INVALID_CONFIG_EXIT)
        failed = [r for r in rows if r.status != "FINISHED"]
        if failed:  # the message alone, exit 1 (a failed JobReturn would add Hydra's "Error executing job ..." and
            # its HYDRA_FULL_ERROR hint, which say nothing about a job that ran in another process)
            print(f"{len(failed)} of {len(rows)} sweep jobs failed (job {', '.join(str(r.index) for r in failed)}; "
                  "see the table above)", file=sys.stderr, flush=True)
            sys.exit(1)
        return self._returns(full, indices, outcomes)

    # ------------------------------------------------------------------ steps
    def _check_options(self) -> None:
        """The launcher's own options, before anything starts (exit 2, as an invalid job)."""
        problems = []
        n = self.max_concurrent_jobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            problems.append(f"hydra.launcher.max_concurrent_jobs={n} must be a number of jobs >= 1 (null, the "
                            "default: as many as fit the cluster)")
        t = self.stop_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            problems.append(f"hydra.launcher.stop_timeout_s={t} must be a number of seconds >= 0")
        if problems:
            print("relax-train: error: invalid sweep launcher options (nothing started):\n"
                  + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
            sys.exit(INVALID_CONFIG_EXIT)

    def _ray_address(self) -> tuple[str, Optional[str]]:
        """The Ray cluster the sweep joins, and the option that names it: `hydra.launcher.address`, else
        `cluster.address`, else RAY_ADDRESS (set for a driver that Ray Jobs started, relax-submit: a submitted
        sweep joins its cluster); None: a Ray instance of the sweep's own."""
        assert self.config is not None
        for option, address in (("hydra.launcher.address", self.address),
                                ("cluster.address", OmegaConf.select(self.config, "cluster.address", default=None)),
                                ("RAY_ADDRESS", os.environ.get("RAY_ADDRESS"))):
            if address:
                return option, str(address)
        return "RAY_ADDRESS", None

    def _check_ray_address(self) -> None:
        """The cluster the sweep joins must accept a TCP connection (`relax.runner.endpoints`, as a single run probes
        `cluster.address` and RAY_ADDRESS), before its jobs are checked, its MLflow parent run opens or Ray starts:
        `ray.init` at an address where nothing listens retries in Ray's C++ client for ever, where neither a Python
        exception nor the driver's SIGTERM handler gets through. Refused with relax-train's one-line error, exit 2."""
        from relax.runner.endpoints import ray_endpoint, unreachable

        option, address = self._ray_address()
        what = {"hydra.launcher.address": "the Ray head the sweep joins (ray start --head)",
                "cluster.address": "a Ray head (ray start --head)",
                "RAY_ADDRESS": "the Ray head that RAY_ADDRESS names (joined: cluster.address is unset)"}[option]
        target = ray_endpoint(option, address, what)
        if target is None:
            return
        for problem in unreachable([target]):
            print(f"relax-train: error: cannot join Ray: {problem}; nothing started (no sweep job, no MLflow run)",
                  file=sys.stderr, flush=True)
            sys.exit(INVALID_CONFIG_EXIT)

    def _dry_run(self, jobs: list[list[str]], indices: list[int]) -> bool:
        """Whether the sweep is a dry run: `dry_run` of each job's composed config (it may be swept). A sweep whose
        jobs disagree is refused (exit 2, nothing started): a dry run starts nothing, and the other jobs would start
        Ray and the sweep's MLflow run for it."""
        # each job's: a swept dry_run (dry_run=true,false) is not in the sweep's own config
        dry = [bool(OmegaConf.select(self._compose(job), "dry_run", default=False)) for job in jobs]
        if all(dry) or not any(dry):
            return any(dry)
        yes = ", ".join(str(i) for i, d in zip(indices, dry, strict=True) if d)
        no = ", ".join(str(i) for i, d in zip(indices, dry, strict=True) if not d)
        print(f"relax-train: error: dry_run is true for job {yes} and false for job {no}: a sweep is a dry run for "
              "all of its jobs or for none (set dry_run=true or leave it out); nothing started", file=sys.stderr)
        sys.exit(INVALID_CONFIG_EXIT)

    def _dry_run_all(self, jobs: list[list[str]], arms: list[Optional[str]], indices: list[int]) -> list[JobReturn]:
        """A sweep's dry run (`dry_run=true`), after the precheck: each job's own dry run, relax-train's task function
        in this process one job after another (as Hydra's basic launcher runs jobs): its summary, its plan and every
        check a start runs before Ray. Nothing starts, as for a single run's dry run: no Ray, no MLflow parent run,
        no job's run, no checkpoint directory. Then one line per job; a job whose checks failed makes the sweep exit
        2, as a single run's dry run does. Each job gets the `tracking.arm` the real sweep would give it (`arms`)."""
        from relax.runner.plan import SWEEP_RAY_ENV

        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        option, address = self._ray_address()
        # each job's plan says the Ray the sweep would run it on (the launcher's), not one of the job's own
        words = (f"the sweep's Ray, the cluster at {address} ({option}) that the sweep launcher joins"
                 if address is not None else "the sweep's Ray instance (local, started by the sweep launcher for its "
                 "jobs)")
        before = os.environ.get(SWEEP_RAY_ENV)
        os.environ[SWEEP_RAY_ENV] = words
        returns: list[JobReturn] = []
        failed: dict[int, str] = {}
        try:
            for index, job, arm in zip(indices, jobs, arms, strict=True):
                print(f"\n== job {index}: {' '.join(masked_override(o) for o in filter_overrides(job))}", flush=True)
                full = [*job, *tracking_overrides(sweep_id=None, parent_run_id=None, arm=arm)]
                sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, full)
                with open_dict(sweep_config):
                    sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{index}"
                    sweep_config.hydra.job.num = index
                ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                              config=sweep_config, job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
                configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
                if ret.status == JobStatus.FAILED:
                    failed[index] = _error_text(ret._return_value)
                returns.append(ret)
        finally:
            if before is None:
                os.environ.pop(SWEEP_RAY_ENV, None)
            else:
                os.environ[SWEEP_RAY_ENV] = before
        print(file=sys.stdout)
        for index, job in zip(indices, jobs, strict=True):
            word = "FAILED" if index in failed else "passed"
            print(f"job {index} ({' '.join(masked_override(o) for o in filter_overrides(job))}): dry run {word}")
        if failed:
            print(f"relax-train: error: sweep dry run: a start would stop before Ray in {len(failed)} of {len(jobs)} "
                  "jobs (nothing started):\n" + "\n".join(
                      f"job {i}:\n" + textwrap.indent(text, "  ") for i, text in failed.items()),
                  file=sys.stderr, flush=True)
            sys.exit(INVALID_CONFIG_EXIT)
        print(f"sweep dry run: {len(jobs)} job{'s' if len(jobs) != 1 else ''}, every job's config valid and every "
              "check a start runs before Ray passed; nothing started (no Ray, no MLflow run, no checkpoint "
              "directory)", flush=True)
        return returns

    def _tracking_enabled(self, dry_run: bool = True) -> bool:
        """Whether the sweep's jobs are tracked (a parent run, the launcher's tags); `dry_run=False`: whether they
        would be without dry_run=true."""
        assert self.config is not None
        if dry_run and OmegaConf.select(self.config, "dry_run", default=False):
            return False  # a dry run starts nothing, so it records nothing either
        return bool(self.tracking and OmegaConf.select(self.config, "tracking.enabled", default=False))

    def _compose(self, overrides: Sequence[str]) -> DictConfig:
        """A job's config as its task function will see it (without the `hydra` node)."""
        assert self.config is not None and self.hydra_context is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    def _arms(self, jobs: list[list[str]]) -> list[Optional[str]]:
        """Derived arms, except where the job's config already names one (`tracking.arm` set by the user) and where
        the job continues a checkpoint (`train.resume=<checkpoint directory>`, e.g. an evaluation sweep of a
        checkpoint): it reopens that run, whose arm stays (a reopened run's tags are set again from its config, and
        `tracking.arm` may not change on resume). `train.resume=auto` keeps its arm: a job that starts fresh, or
        continues its own earlier checkpoint, under the arm that named its directory."""
        derived = derive_arms(jobs)
        arms = []
        for job, arm in zip(jobs, derived, strict=True):
            if arm:
                cfg = self._compose(job)
                resume = OmegaConf.select(cfg, "train.resume", default=None)
                if OmegaConf.select(cfg, "tracking.arm", default=None) or (resume and str(resume) != "auto"):
                    arm = None
            arms.append(arm)
        return arms

    def _precheck(self, jobs: list[list[str]], arms: list[Optional[str]], indices: list[int],
                  sweep_id: Optional[str]) -> None:
        """Compose and check every job before any starts; all invalid jobs are reported at once (exit 2). What a
        check returns as {what: value} (a job's checkpoint directory) no two jobs may share."""
        if not self.precheck:
            return
        check = _load_callable(self.precheck)
        takes_overrides = "overrides" in inspect.signature(check).parameters
        problems: dict[int, list[str]] = {}
        stores: dict[str, list[int]] = {}  # an unreachable tracking store's message -> its jobs (the check's `store`)
        owners: dict[tuple[str, str], list[int]] = {}
        for index, job, arm in zip(indices, jobs, arms, strict=True):
            extra = tracking_overrides(sweep_id=sweep_id, parent_run_id=None, arm=arm)
            try:
                # the job's own overrides, where the check takes them: what its command line set, as the job reads
                # it (Relax: a saved config's saving options an evaluation-only job leaves aside)
                claims = (check(self._compose(job + extra), overrides=job + extra) if takes_overrides
                          else check(self._compose(job + extra)))
            except Exception as exc:  # noqa: BLE001 - any failure makes the job invalid
                store = getattr(exc, "store", None)  # relax.runner.sweep_check.SweepJobError: said once, below
                if store is not None:
                    stores.setdefault(store, []).append(index)
                rest = getattr(exc, "problems", None) if store is not None else [str(exc)]
                if rest:
                    text = rest[0] if len(rest) == 1 else f"{len(rest)} problems:\n" + "\n".join(
                        f"  - {t}" for t in rest)
                    problems.setdefault(index, []).append(textwrap.dedent(text.strip("\n")))
                continue
            if isinstance(claims, Mapping):
                for what, value in claims.items():
                    owners.setdefault((str(what), str(value)), []).append(index)
        for (what, value), shared in owners.items():
            if len(shared) > 1:
                advice = self._own_directory_advice([jobs[indices.index(i)] for i in shared])
                for index in shared:
                    others = ", ".join(str(i) for i in shared if i != index)
                    problems.setdefault(index, []).append(
                        f"{what} {value} is also job {others}'s: two jobs would write the same files (the second "
                        f"would fail on the first's lock); {advice}")
        for store, where in stores.items():  # not a config's mistake: the store is down or the URI wrong
            which = "every job" if len(where) == len(jobs) else f"job {', '.join(str(i) for i in where)}"
            print(f"relax-train: error: {store} ({which}); nothing started (no sweep job, no MLflow run)",
                  file=sys.stderr)
        if problems:
            n = len(problems)
            text = [f"job {index} ({' '.join(masked_override(o) for o in filter_overrides(job))}):\n"
                    + "\n".join(textwrap.indent(p, "  ") for p in problems[index])
                    for index, job in zip(indices, jobs, strict=True) if index in problems]
            print(f"relax-train: error: invalid config in {n} of {len(jobs)} sweep job{'s' if len(jobs) > 1 else ''}"
                  f" (nothing started):\n" + "\n".join(text), file=sys.stderr)
            sys.exit(INVALID_CONFIG_EXIT)
        if stores:
            sys.exit(INVALID_CONFIG_EXIT)

    def _own_directory_advice(self, jobs: Sequence[Sequence[str]]) -> str:
        """How jobs that share a checkpoint directory get one each. Without train.save_dir a run's directory is
        named after its run (tracking.run_name, else the algorithm and seed); jobs that set one train.save_dir and
        already differ in seed or run name share it all the same: only a train.save_dir of each then helps."""
        cfgs = [self._compose(job) for job in jobs]
        named = [tuple(OmegaConf.select(c, key, default=None) for key in ("seed", "tracking.run_name")) for c in cfgs]
        if all(OmegaConf.select(c, "train.save_dir", default=None) for c in cfgs) and len(set(named)) > 1:
            return ("the jobs already differ in seed or tracking.run_name, but train.save_dir names this one "
                    "directory for all of them: give each job a train.save_dir of its own")
        return "make the jobs differ, e.g. in seed, tracking.run_name or train.save_dir"

    def _start_parent(self) -> Optional[str]:
        """The sweep's MLflow parent run, created once per sweep (this also creates a new sqlite store)."""
        if self.parent is not None:
            return self.parent.run_id
        from relax.config.schema import TrackingConfig
        from relax.tracking.mlflow_run import Tracker, TrackingUnavailable
        from relax.tracking.params import TAG_OVERRIDES, TAG_SWEEP_ID
        from relax.tracking.run_options import RunOptions

        assert self.config is not None
        tc = TrackingConfig(uri=str(OmegaConf.select(self.config, "tracking.uri")),
                            experiment=str(OmegaConf.select(self.config, "tracking.experiment")))
        overrides = " ".join(self.config.hydra.overrides.task)
        try:
            self.parent = Tracker.start(tc, RunOptions(background=False, announce=False),
                                        run_name=f"sweep-{self.sweep_id}",
                                        tags={TAG_SWEEP_ID: str(self.sweep_id), TAG_OVERRIDES: overrides or "(none)"})
        except TrackingUnavailable as exc:  # a wrong tracking.uri: the user's to fix, as in a single run (exit 2)
            print(f"relax-train: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(INVALID_CONFIG_EXIT)
        return self.parent.run_id

    def _init_ray(self) -> None:
        """Join the cluster of `address`, `cluster.address` or RAY_ADDRESS, else start a Ray instance of the sweep's
        own; raises RayUnavailable when neither works."""
        import ray

        if ray.is_initialized():
            self.output_ends.install()
            return
        _, address = self._ray_address()
        kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
        plain_ray_log_prefix(os.environ, (sys.stdout, sys.stderr))  # jobs' lines go to either; no colour in a file
        if address is None:
            from relax.runner.plan import LOCAL_RAY_SYSTEM_CONFIG

            kwargs["num_cpus"] = max(os.cpu_count() or 1, 2)
            # the jobs and their roles at normal priority, as a single run's own instance starts them
            kwargs["_system_config"] = LOCAL_RAY_SYSTEM_CONFIG
        else:
            from relax.runner.ray_auth import enable_token_auth

            enable_token_auth()  # a cluster with token authentication refuses a driver that does not send it
        kwargs.update(self.ray_init)
        try:
            # "local": a new instance of the sweep's own, as a single run starts (relax.runner.cluster.RayRuntime);
            # with None, Ray would join the cluster that /tmp/ray/ray_current_cluster names (a user's `ray start
            # --head`, or a stale file left by a head stopped by a signal) and then refuse num_cpus
            ray.init(address=address if address is not None else "local", **kwargs)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            where = f"the Ray cluster at {address}" if address is not None else "a local Ray instance"
            raise RayUnavailable(f"cannot start or join Ray ({where}): {exc}; no sweep job started") from None
        self.started_ray = True
        self.joined = address
        self.output_ends.install()

    def _ray_words(self) -> str:
        """The sweep's Ray in words, for each job's plan line (`relax.runner.plan.ray_source`)."""
        if self.joined is not None:
            option, _ = self._ray_address()
            return f"the sweep's Ray, the cluster at {self.joined} ({option}) that the sweep launcher joined"
        if self.started_ray:
            return "the sweep's Ray instance (local, started by the sweep launcher for its jobs)"
        return "the Ray instance the sweep launcher runs in"

    def _stop_ray(self) -> None:
        import ray

        # the jobs' last lines, which Ray's log monitor forwards after the job returned (bounded: a lost node's never)
        late = self.output_ends.wait(self.returned, self.stopped, OUTPUT_END_WAIT_S)
        if late:
            print(f"relax-train: the last output lines of job(s) {', '.join(map(str, late))} did not reach this "
                  f"process within {OUTPUT_END_WAIT_S:g} s; Ray's log files of the job's worker hold them "
                  "(session_latest/logs in Ray's temporary directory on the job's node)", file=sys.stderr, flush=True)
        self.returned, self.stopped = [], []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        # Ray's own printer back (a Ray this launcher did not start is left running; a shutdown removed it)
        self.output_ends.uninstall()
        self.started_ray = False

    def _concurrency(self, n_jobs: int) -> int:
        """max_concurrent_jobs, else how many jobs fit the cluster's CPUs and GPUs (at least 1)."""
        import ray

        if self.max_concurrent_jobs is not None:  # >= 1 (_check_options)
            return max(1, min(self.max_concurrent_jobs, n_jobs))
        assert self.config is not None
        resources = ray.cluster_resources()
        fits = [n_jobs]
        if self.num_cpus and self.num_cpus > 0:
            fits.append(int(resources.get("CPU", 1) // self.num_cpus))
        gpus = self.num_gpus
        if gpus is None:
            nodes = OmegaConf.select(self.config, "cluster.num_nodes", default=1) or 1
            gpus = nodes * (OmegaConf.select(self.config, "cluster.gpus_per_node", default=0) or 0)
        if gpus and gpus > 0:
            fits.append(int(resources.get("GPU", 0) // gpus))
        return max(1, min(fits))

    def _run_all(self, full: list[list[str]], indices: list[int], jobs: list[list[str]],
                 outcomes: dict[int, _Outcome], sweep_id: Optional[str], started: set[int]) -> None:
        """Run the jobs, at most `_concurrency` at a time; each job's index goes into `started` as it is submitted
        to Ray, and its `_Outcome` into `outcomes` as it ends."""
        import ray

        assert self.config is not None and self.hydra_context is not None
        self._init_ray()
        limit = self._concurrency(len(full))
        print(f"Running at most {limit} job(s) at once on Ray ({ray.cluster_resources().get('CPU', 0):g} CPUs, "
              f"{ray.cluster_resources().get('GPU', 0):g} GPUs)", flush=True)
        remote = ray.remote(num_cpus=0, num_gpus=0, max_calls=1, max_retries=0)(_execute_job)
        ray_words = self._ray_words()
        state = Singleton.get_state()
        cwd = os.getcwd()
        pending = list(range(len(full)))
        running: dict[Any, int] = {}
        submitted: dict[int, float] = {}

        def collect(ref: Any, killed: bool = False) -> None:
            k = running.pop(ref)
            try:
                outcome = ray.get(ref)
                self.returned.append(indices[k])
            except Exception as exc:  # noqa: BLE001 - a crashed worker, an unpicklable result, a cancelled task ...
                if killed:
                    outcome = _Outcome(indices[k], None, None, submitted[k], time.time(), killed=True)
                    self.stopped.append(indices[k])  # it ended its own way: its output's end was written, if begun
                else:
                    outcome = _Outcome(indices[k], None, f"{type(exc).__name__}: {exc}", submitted[k], time.time())
            outcomes[indices[k]] = outcome
            word = "stopped" if outcome.killed else "finished" if outcome.error is None else "FAILED"
            print(f"job {indices[k]} {word} in {outcome.end - outcome.start:.0f} s: "
                  f"{' '.join(filter_overrides(jobs[k]))}", flush=True)

        # the signal, kept: ray.wait turns the Signalled raised inside it into a plain KeyboardInterrupt (its C++
        # wait polls Python's handlers and reports only 'interrupted'), so the exit would be 130 instead of 143
        terminated: list[int] = []

        def on_sigterm(signum: int, frame: Any) -> None:
            terminated.append(signum)
            _terminate_as_interrupt(signum, frame)

        previous = {}
        if threading.current_thread() is threading.main_thread():  # after ray.init, which installs its own
            previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_sigterm)
            # Ctrl-C (SIGINT) stops the jobs even where it was ignored when the driver started (nohup, `&` in a
            # script), as a single relax-train's handler does: `kill -INT` is then still a way to stop the sweep
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            while pending or running:
                while pending and len(running) < limit:
                    k = pending.pop(0)
                    key = job_key(sweep_id, indices[k]) if sweep_id else None
                    ref = remote.remote(indices[k], full[k], self.hydra_context, self.config, self.task_function,
                                        state, cwd, key, ray_words)
                    running[ref] = k
                    submitted[k] = time.time()
                    started.add(indices[k])
                    log.info(f"\t#{indices[k]} : {' '.join(filter_overrides(jobs[k]))}")
                done, _ = ray.wait(list(running), num_returns=1)
                for ref in done:
                    collect(ref)
        except KeyboardInterrupt as exc:
            self._stop_jobs(running, collect)
            if terminated and not isinstance(exc, Signalled):
                raise Signalled(terminated[0]) from None
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _stop_jobs(self, running: dict[Any, int], collect: Callable[..., None]) -> None:
        """Ctrl-C: each running job gets a KeyboardInterrupt through its SIGINT handler (`ray.cancel` without
        force), which stops a Relax run as Ctrl-C does (a checkpoint of its step, its run KILLED); the jobs still
        running after `stop_timeout_s`, or at a second Ctrl-C, are killed."""
        import ray

        if not running:
            return
        print(f"\nrelax-train: interrupted: stopping {len(running)} running job(s), each after its current step with "
              f"a checkpoint (up to {self.stop_timeout_s:g} s; press Ctrl-C again to kill them now)", file=sys.stderr,
              flush=True)
        for ref in running:
            ray.cancel(ref, force=False, recursive=False)  # the job's own roles are stopped by the job
        deadline = time.monotonic() + self.stop_timeout_s
        try:
            while running and (left := deadline - time.monotonic()) > 0:
                done, _ = ray.wait(list(running), num_returns=1, timeout=left)
                for ref in done:
                    collect(ref, killed=True)
        except KeyboardInterrupt:
            pass
        if running:
            print(f"relax-train: killing {len(running)} job(s) that did not stop", file=sys.stderr, flush=True)
            for ref in list(running):
                ray.cancel(ref, force=True)
                running.pop(ref)

    def _rows(self, jobs: list[list[str]], indices: list[int], outcomes: dict[int, _Outcome],
              parent_id: Optional[str], started: set[int]) -> list[JobRow]:
        """The table: each job with its own MLflow run (its `relax.sweep_job` tag, else the run id it returned;
        '-' when neither) and its final reward, the mean of its last 10 steps. A job never submitted to Ray is
        NOT STARTED; one submitted that returned nothing (stopped, or killed at the second Ctrl-C) is KILLED."""
        runs = self._job_runs(parent_id)
        rows = []
        for job, index in zip(jobs, indices, strict=True):
            text = " ".join(filter_overrides(job))
            o = outcomes.get(index)
            run = runs.get(index)
            value = o.ret.return_value if o is not None and o.ret is not None and o.error is None else None
            run_id = _result_field(value, "run_id") or (run.info.run_id if run is not None else None)
            reward = _result_field(value, "final_reward")  # relax-train: the mean of the last 10 steps
            if not isinstance(reward, (int, float)) and run is not None:
                reward = self._final_reward(run.info.run_id)
            reward = float(reward) if isinstance(reward, (int, float)) and math.isfinite(reward) else None
            if o is None and index not in started:
                status = NOT_STARTED
            elif o is None or o.killed:
                status = "KILLED"
            else:
                status = "FINISHED" if o.error is None else "FAILED"
            if status != "FINISHED" and run is not None and run.info.status == "RUNNING":
                # its process is gone without ending its run: killed before its own handler could mark it, or
                # crashed (kill -9, out of memory, a lost node); left RUNNING, it would read as still training in
                # MLflow and relax-compare. A later train.resume=auto of the job reopens it (Tracker.reopen)
                self._mark_ended(run.info.run_id, status)
            seconds = o.end - o.start if o is not None else None
            rows.append(JobRow(index, text, status, run_id, reward, seconds, o.error if o is not None else None,
                               tuple(filter_overrides(job))))
        return rows

    def _tag_statuses(self, rows: Sequence[JobRow]) -> None:
        """The table's status of each job on the parent run (`relax.sweep_jobs`): a job that never started has no
        run of its own to say it."""
        assert self.parent is not None
        text = json.dumps({str(r.index): r.status for r in sorted(rows, key=lambda r: r.index)})
        try:
            self.parent.client.set_tag(self.parent.run_id, JOBS_TAG, text)
        except Exception as exc:  # noqa: BLE001 - the table still says it
            log.warning(f"could not tag the sweep's parent run with its jobs' statuses: {exc}")

    def _mark_ended(self, run_id: str, status: str) -> None:
        """End a job's run that its process left RUNNING with the table's status (KILLED or FAILED)."""
        assert self.parent is not None
        try:
            self.parent.client.set_terminated(run_id, status)
        except Exception as exc:  # noqa: BLE001 - the run stays RUNNING; the table still says it
            log.warning(f"could not mark run {run_id} {status}: {exc}")

    def _final_reward(self, run_id: str) -> Optional[float]:
        """The mean of a run's last 10 logged rewards (a job that returned none: failed or stopped)."""
        from relax.tracking.compare import final_value

        assert self.parent is not None
        try:
            history = [(m.step, m.value) for m in self.parent.client.get_metric_history(run_id, REWARD_METRIC)]
        except Exception as exc:  # noqa: BLE001 - the table is still useful without it
            log.warning(f"could not read {REWARD_METRIC} of run {run_id}: {exc}")
            return None
        return final_value(history, FINAL_REWARD_STEPS) if history else None

    def _job_runs(self, parent_id: Optional[str]) -> dict[int, Any]:
        """The jobs' MLflow runs by job index, from their `relax.sweep_job` tag (best effort: the table shows '-'
        when unknown). A job's run may be in another experiment than the parent's (`tracking.experiment` swept)."""
        if parent_id is None or self.parent is None or self.sweep_id is None:
            return {}
        try:
            client = self.parent.client
            experiments = [e.experiment_id for e in client.search_experiments()]
            found = client.search_runs(experiments, filter_string=f"tags.`{JOB_TAG}` LIKE '{self.sweep_id}/%'",
                                       max_results=5000)
        except Exception as exc:  # noqa: BLE001 - the table is still useful without run ids
            log.warning(f"could not list the sweep's runs: {exc}")
            return {}
        runs: dict[int, Any] = {}
        for r in sorted(found, key=lambda r: r.info.start_time):
            sweep, _, index = r.data.tags.get(JOB_TAG, "").rpartition("/")
            if sweep == self.sweep_id and index.isdigit():
                runs.setdefault(int(index), r)
        return runs

    def _returns(self, full: list[list[str]], indices: list[int], outcomes: dict[int, _Outcome]) -> list[JobReturn]:
        """The jobs' JobReturns (every job finished: a failed or stopped sweep exits before)."""
        out = []
        for overrides, index in zip(full, indices, strict=True):
            o = outcomes.get(index)
            out.append(o.ret if o is not None and o.ret is not None else JobReturn(overrides=list(overrides)))
        return out
