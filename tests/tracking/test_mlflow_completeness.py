"""What every run records besides its metrics: MLflow's system metrics, the prompt sets as dataset inputs, the git
state of the code, the resolved config, and the run's address on a tracking server.

Against a real sqlite MLflow store (tests/tracking/conftest.py); the Session tests use the real config, datasets and
tokenizer of the default experiment, without Ray.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlflow import MlflowClient

from relax.config import ConfigError, load_config
from relax.config.schema import TrackingConfig
from relax.config.validate import validate
from relax.metrics import SYSTEM_PREFIX
from relax.tracking import RunOptions, Tracker
from relax.tracking import git_info as G
from relax.tracking.inputs import CONTEXT_TAG, DatasetRecord, prompts_digest
from relax.tracking.mlflow_run import run_url
from relax.tracking.system_metrics import THREAD_NAME

REPO = Path(__file__).resolve().parents[2]
CPU = f"{SYSTEM_PREFIX}cpu_utilization_percentage"
MLFLOW_SYSTEM_METRICS = ("cpu_utilization_percentage", "system_memory_usage_megabytes",
                         "system_memory_usage_percentage", "disk_usage_percentage", "disk_usage_megabytes",
                         "disk_available_megabytes", "network_receive_megabytes", "network_transmit_megabytes")


def start(cfg: TrackingConfig, **options: Any) -> Tracker:
    """`Tracker.start` of a run named "test", without the start line; `options`: `RunOptions` fields."""
    options.setdefault("announce", False)
    return Tracker.start(cfg, RunOptions(**options), run_name="test")


_EARLIER: set[threading.Thread] = set()  # samplers of trackers other tests left open (not this test's)


@pytest.fixture(autouse=True)
def _earlier_samplers():
    _EARLIER.clear()
    _EARLIER.update(t for t in threading.enumerate() if t.name == THREAD_NAME)


def sampler_threads() -> list[threading.Thread]:
    """This test's system-metrics samplers still running."""
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t not in _EARLIER]


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


# ------------------------------------------------------------------------------------------- system metrics
@pytest.mark.slow
def test_system_metrics_are_sampled_into_the_run_and_stop_with_it(tracking_cfg: TrackingConfig) -> None:
    tracker = start(tracking_cfg, system_metrics_s=0.2)
    assert len(sampler_threads()) == 1
    for step in range(4):
        tracker.log_metrics({"x": float(step)}, step)
        time.sleep(0.2)
    tracker.finish()
    assert sampler_threads() == [] and not tracker.system_metrics.alive  # joined, none left behind
    client = MlflowClient(tracking_cfg.uri)
    run = client.get_run(tracker.run_id)
    assert {f"{SYSTEM_PREFIX}{k}" for k in MLFLOW_SYSTEM_METRICS} <= set(run.data.metrics)  # MLflow's names
    cpu = steps(client, tracker.run_id, CPU)
    assert len(cpu) >= 3 and cpu == list(range(len(cpu)))  # one sample per interval and the last one; steps 0, 1, ..
    assert len(cpu) == tracker.system_metrics.samples
    assert steps(client, tracker.run_id, "x") == [0, 1, 2, 3]  # the training metrics are untouched
    assert 0 <= run.data.metrics[CPU] <= 100  # all cores together


def test_relax_verify_run_checks_the_training_steps_not_the_samples(tracking_cfg: TrackingConfig) -> None:
    """More samples than training steps is no violation of "every metric at most once a step, within the run"."""
    from relax.tracking.verify import check_metric_steps, read_run

    tracker = start(tracking_cfg, system_metrics_s=0.05)
    tracker.log_metrics({"x": 0.0}, 0)
    time.sleep(0.4)
    tracker.finish()
    assert len(steps(MlflowClient(tracking_cfg.uri), tracker.run_id, CPU)) > 1  # samples at steps 0, 1, ...
    record = read_run(tracking_cfg.uri, tracker.run_id, "ledger.jsonl")
    assert sorted(record.histories) == ["x"]
    assert check_metric_steps({k: [s for s, _ in h] for k, h in record.histories.items()}, 1, ["x"]) == []


def test_without_system_metrics_no_thread_and_no_system_keys(tracking_cfg: TrackingConfig) -> None:
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="system metrics interval"):
            start(tracking_cfg, system_metrics_s=bad)  # before a run is created
    assert MlflowClient(tracking_cfg.uri).get_experiment_by_name(tracking_cfg.experiment) is None  # nothing created
    tracker = start(tracking_cfg)
    assert sampler_threads() == [] and tracker.system_metrics is None
    tracker.log_metrics({"x": 1.0}, 0)
    tracker.finish()
    run = MlflowClient(tracking_cfg.uri).get_run(tracker.run_id)
    assert not [k for k in run.data.metrics if k.startswith(SYSTEM_PREFIX)]


def test_a_reopened_run_continues_the_samples(tracking_cfg: TrackingConfig) -> None:
    first = start(tracking_cfg, system_metrics_s=60.0)
    first.finish()  # the last sample only: step 0
    again = Tracker.reopen(tracking_cfg, first.run_id, RunOptions(announce=False, system_metrics_s=60.0), from_step=0)
    again.finish()
    assert steps(MlflowClient(tracking_cfg.uri), first.run_id, CPU) == [0, 1]
    assert sampler_threads() == []


class FakeGPUMonitor:
    """What MLflow's GPUMonitor is on a machine with one GPU and nvidia-ml-py (its names, fixed values)."""

    def __init__(self) -> None:
        self._metrics: dict[str, list[float]] = {}

    def collect_metrics(self) -> None:
        self._metrics.setdefault("gpu_0_utilization_percentage", []).append(50.0)

    def aggregate_metrics(self) -> dict[str, float]:
        return {k: sum(v) / len(v) for k, v in self._metrics.items()}

    def clear_metrics(self) -> None:
        self._metrics.clear()


def test_gpu_metrics_when_a_gpu_monitor_starts_and_a_warning_when_none_does(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from relax.tracking import system_metrics as SM

    real = SM._monitor_class

    def without_gpu_library(name: str) -> Any:
        if name in SM._GPU_MONITORS:
            raise ImportError("`nvidia-ml-py` is not installed")  # as MLflow's GPUMonitor() raises
        return real(name)

    monkeypatch.setattr(SM, "_nvidia_driver_present", lambda: True)
    monkeypatch.setattr(SM, "_monitor_class", without_gpu_library)
    with caplog.at_level(logging.WARNING, logger=SM.__name__):
        assert not SM.SystemMetrics(lambda m, s: None, 1.0).has_gpu_monitor
    assert ["nvidia-ml-py" in r.getMessage() for r in caplog.records] == [True]
    monkeypatch.setattr(SM, "_monitor_class", lambda name: FakeGPUMonitor if name in SM._GPU_MONITORS else real(name))
    logged: list[tuple[dict[str, float], int]] = []
    sampler = SM.SystemMetrics(lambda m, s: logged.append((dict(m), s)), 60.0, first_step=5).start()
    sampler.stop()
    assert sampler.has_gpu_monitor and [s for _, s in logged] == [5]
    assert logged[0][0][f"{SYSTEM_PREFIX}gpu_0_utilization_percentage"] == 50.0


def test_a_failing_sample_is_skipped_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    from relax.tracking import system_metrics as SM

    logged: list[int] = []
    sampler = SM.SystemMetrics(lambda m, s: logged.append(s), 0.05)
    calls = {"n": 0}
    real = sampler.monitors[0].collect_metrics

    def flaky() -> None:
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("sensor gone")
        real()

    monkeypatch.setattr(sampler.monitors[0], "collect_metrics", flaky)
    with caplog.at_level(logging.WARNING, logger=SM.__name__):
        sampler.start()
        time.sleep(0.5)
        sampler.stop()
    assert [r.getMessage().count("sensor gone") for r in caplog.records] == [1]  # once for the run
    assert logged and logged == list(range(len(logged))) and not sampler.alive  # the others, in step order


class Outage:
    """The tracker's store down (what MLflow raises for a sqlite database locked past its timeout) while `down`."""

    def __init__(self, tracker: Tracker, monkeypatch: pytest.MonkeyPatch) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

        self.down = False
        self.error = MlflowException("(sqlite3.OperationalError) database is locked",
                                     error_code=TEMPORARILY_UNAVAILABLE)
        for name in ("log_batch", "log_inputs", "set_terminated", "get_metric_history"):
            monkeypatch.setattr(tracker.client, name, self._wrap(getattr(tracker.client, name)))

    def _wrap(self, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise self.error
            return real(*args, **kwargs)

        return call


def test_an_outage_spools_system_metrics_and_datasets_and_training_goes_on(
        tracking_cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    tracker = start(tracking_cfg, system_metrics_s=0.1, spool_dir=tmp_path, background=False)
    outage = Outage(tracker, monkeypatch)
    outage.down = True
    record = DatasetRecord("digits", "train", "synthetic", "synthetic:digits", "0123456789abcdef", 8)
    with caplog.at_level(logging.WARNING):
        tracker.log_inputs([record])
        for step in range(3):
            tracker.log_metrics({"x": float(step)}, step)
            time.sleep(0.15)
        tracker.flush()
        assert tracker.system_metrics.alive and tracker.system_metrics.samples >= 2  # sampling went on
        assert tracker.spool.pending
        outage.down = False
        tracker.finish()
    assert not [r for r in caplog.records if r.name == "relax.tracking.system_metrics"]
    client = MlflowClient(tracking_cfg.uri)
    assert steps(client, tracker.run_id, "x") == [0, 1, 2]
    assert steps(client, tracker.run_id, CPU) == list(range(tracker.system_metrics.samples))  # each once
    (logged,) = client.get_run(tracker.run_id).inputs.dataset_inputs
    assert (logged.dataset.name, logged.dataset.digest) == ("digits", "0123456789abcdef")
    assert not tracker.spool.path.exists() and sampler_threads() == []


# ------------------------------------------------------------------------------------------- the Session
@pytest.fixture
def session_run(tracking_cfg: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`session_run(overrides, datasets)`: a Session of the default experiment (no Ray) that logs `datasets(cfg)`
    (train set, eval sets) and samples system metrics every 0.2 s; returns the MLflow run and the config."""
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    monkeypatch.chdir(tmp_path)  # not a git repository: no project tags

    def run(overrides: list[str], datasets: Any) -> tuple[Any, Any]:
        cfg = load_config([f"tracking.uri={tracking_cfg.uri}", f"tracking.experiment={tracking_cfg.experiment}",
                           "tracking.progress=false", "tracking.system_metrics_interval_s=0.2", *overrides])
        with Session(cfg, build_plan(cfg), tmp_path / "out") as session:
            session.log_datasets(*datasets(cfg))
            time.sleep(0.3)
            run_id = session.run_id
        assert sampler_threads() == []
        return MlflowClient(tracking_cfg.uri).get_run(run_id), cfg

    return run


def _inputs(run: Any) -> dict[tuple[str, str], Any]:
    out = {}
    for di in run.inputs.dataset_inputs:
        (context,) = [t.value for t in di.tags if t.key == CONTEXT_TAG]
        out[(di.dataset.name, context)] = di.dataset
    return out


def test_a_session_records_datasets_config_git_and_system_metrics(session_run, capsys) -> None:
    from relax.data.datasets import build_datasets, build_eval_sets
    from relax.data.tokenizer import load_tokenizer

    sets: dict[str, Any] = {}

    def datasets(cfg):
        tokenizer = load_tokenizer(cfg.model)
        train, default_eval = build_datasets(cfg, tokenizer)
        sets["train"], sets["eval"] = train, build_eval_sets(cfg, tokenizer, default_eval)
        return sets["train"], sets["eval"]

    run, cfg = session_run(["train.eval_interval=5", "data.num_eval_prompts=4"], datasets)
    inputs = _inputs(run)
    assert set(inputs) == {("digits", "train"), ("digits", "eval")}
    train, evals = inputs[("digits", "train")], inputs[("digits", "eval")]
    assert (train.source_type, json.loads(train.source)) == ("synthetic", {"uri": "synthetic:digits"})
    assert train.digest == prompts_digest((i.prompt_text, i.label) for i in sets["train"])
    assert evals.digest == prompts_digest((i.prompt_text, i.label) for i in sets["eval"]["digits"])
    assert json.loads(train.profile) == {"num_prompts": cfg.data.num_prompts, "num_dropped": 0}
    assert json.loads(evals.profile)["num_prompts"] == 4
    assert [c["name"] for c in json.loads(train.schema)["mlflow_colspec"]] == ["prompt", "label"]

    # the code: this checkout's commit and dirty state; no project tags (the run's directory is not a repository)
    tags = run.data.tags
    assert tags[G.GIT_COMMIT_TAG] == git("rev-parse", "HEAD").strip() == tags[G.MLFLOW_GIT_COMMIT_TAG]
    assert tags[G.GIT_DIRTY_TAG] == str(bool(git("status", "--porcelain").strip())).lower()
    assert G.PROJECT_GIT_COMMIT_TAG not in tags

    # the resolved config, as an artifact and as params; the system metrics of the run
    client = MlflowClient(cfg.tracking.uri)
    assert {"config.yaml", "plan.txt"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert run.data.params["tracking.system_metrics_interval_s"] == "0.2"
    assert len(steps(client, run.info.run_id, CPU)) >= 2


def test_a_file_dataset_is_recorded_by_its_path_and_content(session_run, tmp_path: Path) -> None:
    from relax.data.datasets import load_prompt_file
    from relax.data.tokenizer import load_tokenizer

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"repeat {d}", "label": str(d)}) + "\n" for d in range(6)))
    digests = []
    for _ in range(2):
        run, _cfg = session_run(["data=jsonl", f"data.path={data}"],
                                lambda cfg: (load_prompt_file(data, load_tokenizer(cfg.model), cfg.data), None))
        (dataset,) = _inputs(run).values()
        assert (dataset.name, dataset.source_type, json.loads(dataset.source)) == \
            ("jsonl", "local", {"uri": str(data.resolve())})
        assert json.loads(dataset.profile) == {"num_prompts": 6, "num_dropped": 0}
        digests.append(dataset.digest)
        data.write_text(data.read_text().replace("repeat 5", "repeat 4"))  # the second run: other prompts
    assert digests[0] != digests[1] and len(digests[0]) == 16


# ------------------------------------------------------------------------------------------- git
def _repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git("init", "-q", cwd=path)
    (path / "README").write_text("x\n")
    git("add", "README", cwd=path)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init", cwd=path)
    return path


def test_the_project_repository_is_tagged_next_to_relax(tracking_cfg: TrackingConfig, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    project = _repo(tmp_path / "project")
    monkeypatch.chdir(project)
    tracker = start(tracking_cfg)
    tracker.finish()
    tags = MlflowClient(tracking_cfg.uri).get_run(tracker.run_id).data.tags
    assert tags[G.PROJECT_GIT_COMMIT_TAG] == git("rev-parse", "HEAD", cwd=project).strip()
    assert tags[G.PROJECT_GIT_DIRTY_TAG] == "false"
    assert Path(tags[G.PROJECT_GIT_ROOT_TAG]).resolve() == project.resolve()
    assert tags[G.GIT_COMMIT_TAG] == git("rev-parse", "HEAD").strip()
    (project / "new.py").write_text("")  # an untracked file: dirty
    assert G.git_tags(project)[G.PROJECT_GIT_DIRTY_TAG] == "true"
    assert G.PROJECT_GIT_COMMIT_TAG not in G.git_tags(REPO / "relax")  # Relax's own checkout is not a project


def test_relax_project_dir_names_the_project_when_the_run_starts_elsewhere(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe script runs relax-train in EXP_DIR and names where it was started in RELAX_PROJECT_DIR: the project
    tags are that directory's repository. Control: the same working directory without the variable has none."""
    project = _repo(tmp_path / "project")
    elsewhere = tmp_path / "exp"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv(G.PROJECT_DIR_ENV, raising=False)
    assert G.PROJECT_GIT_ROOT_TAG not in G.git_tags()
    monkeypatch.setenv(G.PROJECT_DIR_ENV, str(project))
    tags = G.git_tags()
    assert Path(tags[G.PROJECT_GIT_ROOT_TAG]).resolve() == project.resolve()
    assert tags[G.PROJECT_GIT_COMMIT_TAG] == git("rev-parse", "HEAD", cwd=project).strip()


def test_git_tags_without_git_or_outside_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import relax

    monkeypatch.setenv("PATH", str(tmp_path))  # no git on the PATH
    assert G.git_tags(tmp_path) == {}
    monkeypatch.undo()
    # an installed copy of Relax inside someone's repository (a virtualenv in a project) is not a Relax checkout
    project = _repo(tmp_path / "project")
    package = project / ".venv" / "relax"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.setattr(relax, "__file__", str(package / "__init__.py"))
    assert G.relax_source_state() is None
    git("add", "-f", ".venv/relax/__init__.py", cwd=project)  # tracked there: it is that checkout's
    assert G.relax_source_state() == G.GitState(str(project.resolve()), git("rev-parse", "HEAD", cwd=project).strip(),
                                                dirty=True)


def test_mlflow_s_own_source_commit_is_kept(tracking_cfg: TrackingConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow.tracking.context.registry as registry

    real = registry.resolve_tags
    monkeypatch.setattr(registry, "resolve_tags", lambda tags=None: {**real(tags), G.MLFLOW_GIT_COMMIT_TAG: "f" * 40})
    tracker = start(tracking_cfg)
    tracker.finish()
    tags = MlflowClient(tracking_cfg.uri).get_run(tracker.run_id).data.tags
    assert tags[G.MLFLOW_GIT_COMMIT_TAG] == "f" * 40 and tags[G.GIT_COMMIT_TAG] == git("rev-parse", "HEAD").strip()


# ------------------------------------------------------------------------------------------- the run's address
def test_the_run_url_on_a_tracking_server() -> None:
    assert run_url("http://mlflow:5000", "3", "abc") == "http://mlflow:5000/#/experiments/3/runs/abc"
    assert run_url("https://host/mlflow/", "0", "r1") == "https://host/mlflow/#/experiments/0/runs/r1"
    assert run_url("sqlite:////tmp/mlflow.db", "3", "abc") is None
    assert run_url("file:///tmp/mlruns", "3", "abc") is None
    server = SimpleNamespace(uri="http://mlflow:5000", experiment_id="7", run_id="abc")
    assert Tracker.ui_command(server) == "http://mlflow:5000/#/experiments/7/runs/abc"  # type: ignore[arg-type]
    local = SimpleNamespace(uri="sqlite:////tmp/m.db", experiment_id="7", run_id="abc")
    assert Tracker.ui_command(local) == "mlflow ui --backend-store-uri sqlite:////tmp/m.db"  # type: ignore[arg-type]


def test_the_start_line_names_the_run_and_where_to_view_it(tracking_cfg: TrackingConfig) -> None:
    out = io.StringIO()
    tracker = start(tracking_cfg, announce=True, stream=out)
    tracker.finish()
    assert out.getvalue().strip().endswith(f"; view: mlflow ui --backend-store-uri {tracking_cfg.uri}")
    assert tracker.run_id in out.getvalue()


# ------------------------------------------------------------------------------------------- config
def test_the_system_metrics_fields_are_validated() -> None:
    cfg = load_config([])
    assert cfg.tracking.system_metrics and cfg.tracking.system_metrics_interval_s == 10.0

    def problems(**tracking: Any) -> list[str]:
        return [v.message for v in validate(dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking,
                                                                                                 **tracking)))]

    assert problems(system_metrics_interval_s=0.5) == []
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert problems(system_metrics_interval_s=bad) == [
            f"tracking.system_metrics_interval_s={bad} must be a number of seconds > 0"]
    assert problems(system_metrics=False) == []
    assert problems(system_metrics=False, system_metrics_interval_s=5.0) == [
        "tracking.system_metrics_interval_s=5.0 has no effect with tracking.system_metrics=false"]
    with pytest.raises(ConfigError):
        load_config(["tracking.system_metrics=false", "tracking.system_metrics_interval_s=1"])


def test_the_store_keeps_one_input_per_dataset(tracking_cfg: TrackingConfig) -> None:
    """Logging the same datasets again (a reopened run) adds nothing; other prompts add a dataset."""
    tracker = start(tracking_cfg)
    record = DatasetRecord("digits", "train", "synthetic", "synthetic:digits", "0123456789abcdef", 8)
    tracker.log_inputs([record])
    tracker.log_inputs([record])
    tracker.log_inputs([dataclasses.replace(record, digest="fedcba9876543210")])
    tracker.finish()
    inputs = MlflowClient(tracking_cfg.uri).get_run(tracker.run_id).inputs.dataset_inputs
    assert sorted(d.dataset.digest for d in inputs) == ["0123456789abcdef", "fedcba9876543210"]
    with pytest.raises(ValueError):
        DatasetRecord("digits", "test", "synthetic", "synthetic:digits", "x", 1)
    db = tracking_cfg.uri.removeprefix("sqlite:///")
    with sqlite3.connect(db) as conn:  # MLflow's column limit on a digest
        assert conn.execute("select max(length(digest)) from datasets").fetchone()[0] <= 36
