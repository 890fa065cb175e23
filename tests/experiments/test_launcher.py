"""The Ray sweep launcher on a dummy Hydra app: jobs overlap in time, one failing job does not stop the
others, invalid jobs are all reported before anything starts, and MLflow gets a parent run with children."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# its tests share module-scoped sweep: one xdist worker runs them in a row
pytestmark = [pytest.mark.xdist_group("launcher"), pytest.mark.slow]

APP = Path(__file__).with_name("dummy_app.py")


def _start(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(APP), "-m", *overrides], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: int = 240) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _sweep(tmp_path: Path, *overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return _finish(_start(tmp_path, *overrides), timeout)


def _store(directory: Path, template: Path) -> None:
    """The sweep's store (sqlite:///mlflow.db in its directory), copied from the migrated empty template: creating
    one runs every schema migration, seconds of CPU that are not what these tests are about."""
    shutil.copyfile(template, directory / "mlflow.db")


@pytest.fixture(scope="module")
def two_sweeps(tmp_path_factory, mlflow_template):
    """The module's two sweeps (`sweep`, `lost_jobs`), each in its own directory and store, run at the same time:
    the first's jobs mostly sleep, and each sweep's checks read only its own records, store and output."""
    tmp, lost = tmp_path_factory.mktemp("sweep"), tmp_path_factory.mktemp("lost")
    _store(tmp, mlflow_template)
    _store(lost, mlflow_template)
    first = _start(tmp, "lr=0.1,0.2,0.3", "seed=1", "fail_seed=1", "fail_lr=0.1", "sleep_s=3",
                   "hydra.launcher.max_concurrent_jobs=2")
    second = _start(lost, "seed=1,1,2", "fail_job=0", "crash_job=2", "sleep_s=0")
    try:
        return (tmp, _finish(first)), (lost, _finish(second))
    finally:
        if second.poll() is None:  # the first timed out: the second is not left running
            second.kill()


@pytest.fixture(scope="module")
def sweep(two_sweeps):
    """3 jobs (lr), 2 at a time, each sleeping 3 s; the first, lr=0.1, raises, and the third waits for a free slot
    (the first's, as a rule: it started first). Three jobs are the fewest that show the limit with a failing job
    among them; how arms are derived from several swept keys, seeds left out, is tested in test_sweep_helpers.py."""
    return two_sweeps[0]


def test_jobs_run_in_parallel_and_a_failure_does_not_stop_the_others(sweep):
    tmp, proc = sweep
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # the sweep reports its failed job
    records = [json.loads(p.read_text()) for p in sorted((tmp / "times").glob("*.json"))]
    assert sorted(r["num"] for r in records) == [0, 1, 2], out  # every job ran, the failing one included
    # at most 2 at once, and some pair overlapped in time
    spans = sorted((r["start"], r["end"]) for r in records)
    overlaps = [(a, b) for i, a in enumerate(spans) for b in spans[i + 1:] if b[0] < a[1]]
    assert overlaps, spans
    for t in [s for s, _ in spans]:
        assert sum(1 for s, e in spans if s <= t < e) <= 2
    assert len({r["pid"] for r in records}) == 3  # one fresh worker process per job
    # at normal priority (Ray's default of 15 lets any busy process starve the jobs and the roles they start)
    assert [r["niceness"] for r in records] == [os.nice(0)] * 3
    # the table
    table = out[out.index("2 of 3 jobs finished"):]
    rows = [line.split() for line in table.splitlines() if line[:1].isdigit() and " lr=" in line]
    status = {r[0]: next(w for w in r if w in ("FINISHED", "FAILED")) for r in rows}
    assert status == {"0": "FAILED", "1": "FINISHED", "2": "FINISHED"}
    assert "RuntimeError: boom (seed=1)" in table
    assert "1 of 3 sweep jobs failed (job 0; see the table above)" in proc.stderr
    # the failure is the table's and this line's to tell: not Hydra's, whose job ran in another process
    assert "HYDRA_FULL_ERROR" not in out and "Error executing job" not in out


def test_mlflow_parent_and_children(sweep):
    from mlflow import MlflowClient

    tmp, proc = sweep
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    exp = client.get_experiment_by_name("dummy")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 3, proc.stdout
    parent = parents[0]
    sweep_id = parent.data.tags["sweep_id"]
    assert parent.info.status == "FAILED"  # one job failed
    assert parent.data.tags["overrides"] == "lr=0.1,0.2,0.3 seed=1 fail_seed=1 fail_lr=0.1 sleep_s=3"
    assert parent.info.start_time <= min(c.info.start_time for c in children)
    by_overrides = {c.data.tags["overrides"]: c for c in children}
    assert set(by_overrides) == {f"lr={lr} seed=1 fail_seed=1 fail_lr=0.1 sleep_s=3" for lr in (0.1, 0.2, 0.3)}
    for text, c in by_overrides.items():
        assert c.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert c.data.tags["sweep_id"] == sweep_id
        lr, seed = text.split()[0], text.split()[1]
        assert c.data.tags["arm"] == lr  # the swept key
        assert c.data.tags["seed"] == seed.split("=")[1]
        assert c.info.run_id in proc.stdout  # the table names the run
    assert by_overrides["lr=0.1 seed=1 fail_seed=1 fail_lr=0.1 sleep_s=3"].info.status == "FAILED"
    # each row names its job's own run and the mean of its last 10 rewards (all 3 here: lr + 0, 1, 2): the failed
    # job's is its logged mean 1.1 (its last reward was 2.1); the others' are what they returned (lr + 2)
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line[:1].isdigit() and " lr=" in line}
    for index, lr, reward in (("0", "0.1", "1.1000"), ("1", "0.2", "2.2000"), ("2", "0.3", "2.3000")):
        run = by_overrides[f"lr={lr} seed=1 fail_seed=1 fail_lr=0.1 sleep_s=3"]
        assert rows[index][1] == f"lr={lr}" and rows[index][-2:] == [run.info.run_id, reward], rows[index]
        assert run.data.tags["relax.sweep_job"] == f"{sweep_id}/{index}"


@pytest.fixture(scope="module")
def lost_jobs(two_sweeps):
    """3 jobs, two of them lost: job 0 (seed=1) raises before it opens its MLflow run, job 1 has the same overrides
    (seed=1) and finishes, job 2 (seed=2) kills its own process (SIGKILL) once its run is open. Returns (directory,
    the sweep's process, the jobs' runs by job index, the table's rows by job index)."""
    from mlflow import MlflowClient

    tmp, proc = two_sweeps[1]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("dummy").experiment_id])
    jobs = {r.data.tags["relax.sweep_job"].rpartition("/")[2]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line[:2] in ("0 ", "1 ", "2 ")}
    return tmp, proc, parent, jobs, rows


def test_a_job_without_a_run_is_not_credited_with_another_jobs(lost_jobs):
    """Two jobs with the same overrides (`seed=1,1`); the first fails before it opens its MLflow run. Its row says
    `-` (no run, no reward) and the second's names the second's run. Before, rows were matched to runs by their
    overrides tag, so the failed job showed the other's run and reward."""
    _, proc, _, jobs, rows = lost_jobs
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert sorted(jobs) == ["1", "2"], proc.stdout + proc.stderr  # job 0 opened none
    assert rows["0"][-4] == "FAILED" and rows["0"][-1] == "-", rows  # no run, no reward
    assert rows["1"][-3:] == ["s", jobs["1"].info.run_id, "2.1000"], rows
    assert "RuntimeError: boom before its run (job 0)" in proc.stdout


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_concurrent_jobs_below_one_is_refused(tmp_path, value):
    """`max_concurrent_jobs=0` was taken as unset (as many as fit); now refused before anything starts, exit 2. The
    control, a positive value, is the module's sweep (=2)."""
    proc = _sweep(tmp_path, "lr=0.1,0.2", f"hydra.launcher.max_concurrent_jobs={value}", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"relax-train: error: invalid sweep launcher options (nothing started):\n  - "
            f"hydra.launcher.max_concurrent_jobs={value} must be a number of jobs >= 1") in proc.stderr
    assert not (tmp_path / "times").exists() and not (tmp_path / "mlflow.db").exists()


def test_invalid_jobs_are_all_reported_before_anything_starts(tmp_path):
    proc = _sweep(tmp_path, "lr=0.1,-1,-2", "seed=1", "sleep_s=30", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "invalid config in 2 of 3 sweep jobs" in proc.stderr
    assert "job 1 (lr=-1 seed=1 sleep_s=30)" in proc.stderr and "job 2 (lr=-2" in proc.stderr
    assert "lr=-1 must be >= 0" in proc.stderr
    assert not (tmp_path / "times").exists()  # nothing ran
    assert not (tmp_path / "mlflow.db").exists()  # no parent run either


def _stale_ray_tmpdir() -> Path:
    """A private Ray temp dir (RAY_TMPDIR) holding what a Ray head stopped by a signal leaves behind:
    ray/ray_current_cluster naming an address where nothing listens (a user's `ray start --head` writes it too)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="relax-stale-", dir="/tmp"))  # short: Ray's socket paths (107 bytes)
    (ray_tmp / "ray").mkdir()
    with socket.socket() as s:  # a port where nothing listens: the head that wrote the file is gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
    return ray_tmp


def test_ctrl_c_stops_the_running_jobs_of_a_sweep_beside_a_stale_ray_session_file(tmp_path, mlflow_template):
    """Ctrl-C (SIGINT) on the sweep's driver: each running job gets the interrupt (here the default
    KeyboardInterrupt, which ends its MLflow run KILLED), the parent ends KILLED and the table names each job's run.
    The third job, queued behind the two (max_concurrent_jobs=2), never starts: NOT STARTED in the table and in the
    parent run's relax.sweep_jobs tag, with no run of its own (before, it was listed KILLED as if it had run).
    SIGTERM takes the same path (its handler raises the interrupt): a real sweep stopped by SIGTERM is
    tests/experiments/test_relax_sweep.py's, the exit code of each is test_sigterm_on_the_driver_exits_143_....

    The sweep runs beside a stale session file: a Ray head stopped by a signal leaves its address in <Ray's temp
    dir>/ray_current_cluster (a user's `ray start --head` writes it too); the sweep starts a Ray instance of its own,
    as a single run does (docs/operations.md, "A Ray left behind"), and its jobs run. Before, ray.init(address=None,
    num_cpus=...) read that file, tried to join the address and raised `ValueError: When connecting to an existing
    cluster, num_cpus and num_gpus must not be provided` (a traceback, exit 1, no job started, every job listed
    KILLED). The file is written into a private RAY_TMPDIR, so no other Ray instance on the machine is touched. (The
    sweep that finishes is the module's, `sweep` and `lost_jobs`: a stale file changes nothing of what follows
    ray.init.)"""
    from mlflow import MlflowClient

    _store(tmp_path, mlflow_template)
    ray_tmp = _stale_ray_tmpdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONUNBUFFERED="1", RAY_TMPDIR=str(ray_tmp))
    try:
        proc = subprocess.Popen([sys.executable, str(APP), "-m", "lr=0.1,0.2,0.3", "seed=1", "sleep_s=300",
                                 "hydra.launcher.max_concurrent_jobs=2"], cwd=tmp_path,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 120
            while (len(list(tmp_path.glob("times/started-*"))) < 2 and proc.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.1)  # polling for the jobs' files: both runs open, both jobs in their sleep
            started = len(list(tmp_path.glob("times/started-*")))
            if started == 2:
                proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        sessions = list((ray_tmp / "ray").glob("session_2*"))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert "num_cpus and num_gpus must not be provided" not in out, out
    assert sessions, out  # its own instance, in the temp dir it was given
    assert started == 2, out  # both jobs ran on it
    assert proc.returncode == -signal.SIGINT, out  # the KeyboardInterrupt leaves the dummy app (relax-train: 130)
    assert "interrupted: stopping 2 running job(s)" in out
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("dummy").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["overrides"].split()[0]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert parent.info.status == "KILLED" and sorted(children) == ["lr=0.1", "lr=0.2"]
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line[:2] in ("0 ", "1 ", "2 ")}
    for lr, run in children.items():
        assert run.info.status == "KILLED", lr
        assert "KILLED" in rows[lr] and run.info.run_id in rows[lr], rows  # its own run
    assert rows["lr=0.3"][2:] == ["NOT", "STARTED", "-"], rows  # no time, no run, no reward
    assert json.loads(parent.data.tags["relax.sweep_jobs"]) == {"0": "KILLED", "1": "KILLED", "2": "NOT STARTED"}
    assert not (tmp_path / "times" / "started-2").exists()


def test_sigterm_on_the_driver_exits_143_as_on_a_single_run(monkeypatch, capsys):
    """The driver's SIGTERM handler raises `Signalled(SIGTERM)`, a KeyboardInterrupt (the launcher stops its jobs
    as on Ctrl-C, above), and relax-train exits with it 128 + 15 = 143, as a single run stopped by SIGTERM does and a
    scheduler expects; before, every interrupt of a sweep exited 130, as if it were Ctrl-C. Control: a plain
    KeyboardInterrupt (Ctrl-C on the driver) still exits 130."""
    import hydra

    from hydra_plugins.relax_ray_launcher.launcher import _terminate_as_interrupt
    from relax.cli import train as cli

    with pytest.raises(KeyboardInterrupt) as raised:
        _terminate_as_interrupt(signal.SIGTERM, None)
    for interrupt, code in ((raised.value, 143), (KeyboardInterrupt(), 130)):
        def fake_main(*args, interrupt=interrupt, **kwargs):
            def decorate(task):
                def run():
                    raise interrupt  # what Hydra's main lets through from the launcher
                return run
            return decorate

        monkeypatch.setattr(hydra, "main", fake_main)
        monkeypatch.setattr(sys, "argv", ["relax-train", "-m", "seed=1,2"])
        with pytest.raises(SystemExit) as exited:
            cli.main()
        assert exited.value.code == code
        err = capsys.readouterr().err
        assert "the MLflow run is marked KILLED" in err and "Traceback" not in err
        assert ("SIGTERM received" in err) == (code == 143), err


def test_a_crashed_jobs_run_is_ended_failed_with_the_sweep(lost_jobs):
    """A job whose process dies with its MLflow run open (SIGKILL from the job itself, right after its run opened:
    kill -9, out of memory, a lost node) is FAILED in the table, and its run is ended FAILED when the sweep ends.
    Before, the run stayed RUNNING for good (only a job stopped by the sweep's Ctrl-C was ended), so MLflow and
    relax-compare showed it as still training. Control: the other job's run ends FINISHED by itself."""
    tmp, proc, parent, jobs, rows = lost_jobs
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert (tmp / "times" / "started-2").exists() and not (tmp / "times" / "2.json").exists()  # crashed
    assert {k: r.info.status for k, r in jobs.items()} == {"1": "FINISHED", "2": "FAILED"}, out
    assert parent.info.status == "FAILED"
    assert jobs["2"].info.end_time is not None
    assert rows["2"][1] == "seed=2" and "FAILED" in rows["2"] and jobs["2"].info.run_id in rows["2"], rows
    assert rows["1"][1] == "seed=1" and "FINISHED" in rows["1"], rows


def test_a_store_that_cannot_be_opened_is_one_error_line_before_anything_starts(tmp_path):
    """tracking.uri naming a sqlite file where nothing can be created: the sweep's parent run cannot start. Before,
    a traceback through Hydra's sweeper (exit 1); now relax-train's one-line error, exit 2, as a single run says it,
    and no job ran. (relax-train's own precheck refuses it even earlier: test_sweep_precheck.py.) Control: the
    module's sweeps, on a writable store."""
    proc = _sweep(tmp_path, "seed=1,2", "sleep_s=0", "tracking.uri=sqlite:////proc/nope/mlflow.db", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("relax-train: error: ")]
    assert "MLflow store sqlite:////proc/nope/mlflow.db is unavailable when the run starts" in line
    assert not (tmp_path / "times").exists()
