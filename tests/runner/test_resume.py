"""Checkpoints and resume: the default location, atomic commits, the config check, and `kill -9` + resume=auto.

The end-to-end test runs `relax-train` as a user does: a subprocess on a real local Ray and a real MLflow sqlite
store, in the hybrid mode (a batch generated ahead is in every checkpoint), killed with SIGKILL between two
checkpoints, then continued with `train.resume=auto`; the record and the final weights are compared with those of
an uninterrupted run of the same seed, and `relax-verify-run` checks its ledger. The run is agentic
(`data=guess_number`: episodes of several turns; single-turn responses are their one-turn case), so the batches a
checkpoint holds are episodes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from relax.config import load_config
from relax.metrics import SYSTEM_PREFIX
from relax.runner import checkpoint
from relax.runner.checkpoint import Checkpoints
from relax.runner.errors import RunError
from relax.tracking.params import STANDARD_TAG_KEYS

# ---------------------------------------------------------------------------------------------- helpers


def fake_save(ckpts: Checkpoints, step: int, payload: str = "w") -> Path:
    """What Cluster.save does, without Ray: the roles write into the staging directory, then it is committed."""
    staging = ckpts.staging(step)
    (staging / "policy").mkdir()
    (staging / "policy" / "model.safetensors").write_text(f"{payload}{step}")
    return ckpts.commit(staging, step, {"step": step, "sampler": {}})


def names(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if p.name != checkpoint.LOCK)


# ------------------------------------------------------------------------------------- location and naming


def test_default_save_dir_is_stable_per_experiment_and_run_name(tmp_path):
    cfg = load_config([])
    assert checkpoint.default_save_dir(cfg, tmp_path) == tmp_path / "checkpoints" / "relax" / "grpo-seed1"
    cfg = load_config(["algorithm=rloo", "seed=7", "tracking.experiment=my exp"])
    assert checkpoint.resolve_save_dir(cfg, tmp_path) == tmp_path / "checkpoints" / "my_exp" / "rloo-seed7"
    cfg = load_config(["tracking.run_name=baseline", "seed=2"])
    assert checkpoint.resolve_save_dir(cfg, tmp_path) == tmp_path / "checkpoints" / "relax" / "baseline"
    # a sweep's arm (swept keys) names the directory, made filesystem-safe
    cfg = load_config(["tracking.arm='algorithm=m2po,algorithm.kl2_budget=0.02'", "seed=3"])
    assert checkpoint.run_name(cfg) == "algorithm=m2po,algorithm.kl2_budget=0.02-seed3"
    assert "/" not in checkpoint.resolve_save_dir(cfg, tmp_path).name
    cfg = load_config(["train.save_dir=ckpt/here"])
    assert checkpoint.resolve_save_dir(cfg, tmp_path) == tmp_path / "ckpt" / "here"


def test_keep_checkpoints_must_be_positive():
    from relax.config import ConfigError

    with pytest.raises(ConfigError, match="keep_checkpoints=0 must be > 0"):
        load_config(["train.keep_checkpoints=0"])


# ------------------------------------------------------------------------------------------ atomic commit


def test_commit_keeps_the_newest_and_removes_older_only_after(tmp_path):
    cfg = load_config(["train.keep_checkpoints=2"])
    with Checkpoints(cfg, tmp_path) as ckpts:
        save_dir = ckpts.save_dir
        fake_save(ckpts, 2)
        assert names(save_dir) == ["step_000002"]
        fake_save(ckpts, 4)
        assert names(save_dir) == ["step_000002", "step_000004"]
        fake_save(ckpts, 6)
        assert names(save_dir) == ["step_000004", "step_000006"]  # no staging directory left behind
    state = json.loads((save_dir / "step_000006" / "state.json").read_text())
    assert state["step"] == 6 and state["lineage"] == ckpts.lineage
    assert state["config"]["train.keep_checkpoints"] == "2"  # the resolved config is recorded ...
    assert "keep_checkpoints: 2" in (save_dir / "step_000006" / "config.yaml").read_text()  # ... for people too
    assert checkpoint.latest(save_dir) == save_dir / "step_000006"


def test_a_half_written_checkpoint_is_ignored_by_resume_and_cleaned(tmp_path):
    cfg = load_config([])
    with Checkpoints(cfg, tmp_path) as ckpts:
        fake_save(ckpts, 2)
        partial = ckpts.staging(4)  # a kill -9 during the save of step 4
        (partial / "policy").mkdir()
        (partial / "policy" / "model.safetensors").write_text("half")
        export = ckpts.save_dir / ".tmp-hf-0a1b2c3d"  # a kill -9 during the export to hf/ (train.save_hf)
        export.mkdir()
        (export / "config.json").write_text("{}")
    save_dir = ckpts.save_dir
    assert checkpoint.latest(save_dir) == save_dir / "step_000002"
    with Checkpoints(load_config(["train.resume=auto"]), tmp_path) as resumed:
        assert resumed.resume.path == save_dir / "step_000002" and resumed.resume.step == 2
        assert resumed.lineage == ckpts.lineage  # the same run goes on
        assert names(save_dir) == ["step_000002"]  # the temp dir is gone


def test_a_fresh_run_sets_an_earlier_runs_checkpoints_aside_and_deletes_nothing(tmp_path, capsys):
    cfg = load_config(["train.keep_checkpoints=1"])
    with Checkpoints(cfg, tmp_path) as first:
        fake_save(first, 4)
    with Checkpoints(cfg, tmp_path) as second:  # train.resume unset: a new run in the same place
        assert second.resume is None and second.lineage != first.lineage
        aside = second.save_dir / "earlier" / first.lineage
        assert f"to {aside}" in capsys.readouterr().err
        assert names(aside) == ["step_000004"] and checkpoint.latest(second.save_dir) is None
        fake_save(second, 2)
        fake_save(second, 4)  # same step name as the earlier run's: no clash, it is elsewhere
        assert [n for n in names(second.save_dir) if n.startswith("step_")] == ["step_000004"]  # its own pruned
        assert checkpoint.read_state(checkpoint.latest(second.save_dir))["lineage"] == second.lineage
    assert checkpoint.read_state(aside / "step_000004")["lineage"] == first.lineage  # the earlier run is intact
    with Checkpoints(load_config(["train.keep_checkpoints=1", f"train.resume={aside}"]), tmp_path) as again:
        assert again.resume.path == aside / "step_000004"


def test_the_same_step_again_replaces_the_old_checkpoint(tmp_path):
    cfg = load_config([])
    with Checkpoints(cfg, tmp_path) as ckpts:
        fake_save(ckpts, 2, payload="old")
        fake_save(ckpts, 2, payload="new")
        assert names(ckpts.save_dir) == ["step_000002"]
        assert (ckpts.save_dir / "step_000002" / "policy" / "model.safetensors").read_text() == "new2"


def test_one_run_at_a_time_per_directory(tmp_path):
    cfg = load_config([])
    with Checkpoints(cfg, tmp_path):
        with pytest.raises(RunError, match="in use by another running relax-train"):
            Checkpoints(cfg, tmp_path).__enter__()
    with Checkpoints(cfg, tmp_path):  # released at exit (and by the kernel when the process dies)
        pass


# ---------------------------------------------------------------------------------------- the config check


def test_resume_refuses_a_different_config_and_names_the_fields(tmp_path):
    with Checkpoints(load_config(["train.lr=0.001"]), tmp_path) as ckpts:
        fake_save(ckpts, 2)
    changed = load_config(["train.resume=auto", "train.lr=0.01", "rollout.temperature=0.7"])
    with pytest.raises(RunError) as info:
        Checkpoints(changed, tmp_path).__enter__()
    message = str(info.value)
    assert "2 fields differ" in message
    assert "train.lr: 0.001 -> 0.01" in message and "rollout.temperature: 1.0 -> 0.7" in message
    # the lock of the refused attempt is released: the directory stays usable
    allowed = ["train.resume=auto", "train.lr=0.001", "train.num_rollout=99", "tracking.progress=false",
               "train.save_interval=5", "train.keep_checkpoints=3"]
    with Checkpoints(load_config(allowed), tmp_path) as ok:
        assert ok.resume.step == 2
        assert ok.resume.changed["train.num_rollout"] == ("60", "99")
        assert "train.lr" not in ok.resume.changed


def test_explicit_resume_directory_is_checked_too(tmp_path):
    with Checkpoints(load_config(["seed=1"]), tmp_path) as ckpts:
        path = fake_save(ckpts, 2)
    with pytest.raises(RunError, match="seed: 1 -> 2"):
        Checkpoints(load_config([f"train.resume={path}", "seed=2", "train.save=false"]), tmp_path).__enter__()


def test_num_rollout_below_the_checkpoints_step_is_refused_naming_both_numbers(tmp_path):
    """`train.num_rollout` is the run's total: 1 with a checkpoint of 2 steps trains nothing and is no evaluation, so
    it is refused before anything starts, by the check the dry run makes too (`checkpoint.probe`); 0 and the
    checkpoint's own step (evaluations of it) and more (training it further) go on."""
    with Checkpoints(load_config([]), tmp_path) as ckpts:
        path = fake_save(ckpts, 2)
    for resume in ("auto", str(path)):
        below = load_config([f"train.resume={resume}", "train.num_rollout=1"])
        for attempt in (lambda c: Checkpoints(c, tmp_path).__enter__(), lambda c: checkpoint.probe(c, tmp_path)):
            with pytest.raises(RunError) as info:
                attempt(below)
            assert str(info.value) == (
                f"train.resume={resume}: train.num_rollout=1 is below the 2 steps checkpoint {path} holds, so this run "
                "would train nothing: train.num_rollout is the run's total number of steps, not the steps to add. To "
                "train it further give the total, e.g. train.num_rollout=3 (1 more step); to evaluate it, "
                "train.num_rollout=0 (or 2)")
    for n in (0, 2, 3):
        with Checkpoints(load_config([f"train.resume={path}", f"train.num_rollout={n}"]), tmp_path) as ok:
            assert ok.resume.step == 2


@pytest.mark.slow
def test_cli_refusal_is_one_message_exit_2_before_anything_starts(tmp_path, capfd, monkeypatch, ray_not_started):
    """`relax-train` runs in this process (tests/relax_train_inprocess.py): the refusal is a pre-Ray `RunError` of
    `run`, which the CLI turns into its message and exit code as for every other one; that path in a `relax-train`
    process of its own: tests/runner/test_training.py (`test_cli_reports_bad_data_without_traceback`)."""
    from relax_train_inprocess import relax_train

    with Checkpoints(load_config(["train.lr=0.5"]), tmp_path) as ckpts:  # the default location under tmp_path
        fake_save(ckpts, 2)
    monkeypatch.chdir(tmp_path)
    code, out, err = relax_train(["train.resume=auto", "tracking.progress=false"], capfd)
    assert code == 2, err[-3000:]
    assert "train.lr: 0.5 -> " in err and "step_000002" in err
    assert "Traceback" not in err + out
    assert not (tmp_path / "mlflow.db").exists() and not ray_not_started  # refused before tracking and Ray started
    # a num_rollout below the checkpoint's step (the dry run too): one message naming both numbers, exit 2
    code, out, err = relax_train(["train.resume=auto", "train.lr=0.5", "train.num_rollout=1", "dry_run=true",
                                  "tracking.progress=false"], capfd)
    assert code == 2, err[-3000:]
    assert "train.num_rollout=1 is below the 2 steps checkpoint" in err and "train.num_rollout=3" in err
    assert "Traceback" not in err + out
    assert not (tmp_path / "mlflow.db").exists() and not ray_not_started


# ------------------------------------------------------------------------- the session: MLflow and commits


class RecordingCluster:
    """Cluster.save without Ray, recording which steps of a metric the store held when the checkpoint was saved."""

    def __init__(self, uri: str):
        self.uri, self.seen = uri, {}

    def save(self, ckpts: Checkpoints, step: int, state: dict, rollout: dict | None = None) -> Path:
        from mlflow import MlflowClient

        history = MlflowClient(self.uri).get_metric_history(state["mlflow_run_id"], "x")
        self.seen[step] = sorted(m.step for m in history)
        staging = ckpts.staging(step)
        return ckpts.commit(staging, step, state)


def _session(overrides: list[str], cwd: Path, db: Path):
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    cfg = load_config([f"tracking.uri=sqlite:///{db}", "tracking.progress=false", *overrides])
    ckpts = Checkpoints(cfg, cwd)
    return ckpts, lambda: Session(cfg, build_plan(cfg), cwd / "out", checkpoints=ckpts)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_metrics_are_in_the_store_before_the_checkpoint_that_covers_them(tmp_path, mlflow_template):
    db = tmp_path / "mlflow.db"
    shutil.copyfile(mlflow_template, db)
    ckpts, session = _session([], tmp_path, db)
    cluster = RecordingCluster(f"sqlite:///{db}")
    with ckpts, session() as s:
        for step in range(5):
            s.log({"x": float(step)}, step)
            if step % 2 == 1:
                s.save_checkpoint(cluster, step + 1, {"sampler": {}})
        run_id = s.tracker.run_id
    assert cluster.seen == {2: [0, 1], 4: [0, 1, 2, 3]}  # default flush: every 10 steps or 15 s, yet all there
    assert checkpoint.read_state(checkpoint.latest(ckpts.save_dir))["mlflow_run_id"] == run_id


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_reopened_run_keeps_its_ledger_and_records_every_resume(tmp_path, mlflow_template):
    """A 3-step run (checkpoints 2 and 3), then its older checkpoint 2 evaluated (trains nothing: the run's 3-step
    ledger stays), then resumed from checkpoint 2 to 4 steps with step 2 trained again on other samples and one
    more prompt drawn (as a step of dynamic sampling that set aside nothing the second time): the run's ledger is
    that job's, the checkpoint's steps then the two it trained, as its checkpoints hold, and relax-verify-run passes
    (a ledger that kept the first job's step 2 and added this job's step 3 only would lose ids 24..31). The
    relax.resumed.<n> tags keep both continuations, relax.resumed the last."""
    import torch
    from mlflow import MlflowClient

    from relax.cli import verify_run
    from relax.runner.ledger import Ledger

    db = tmp_path / "mlflow.db"
    shutil.copyfile(mlflow_template, db)
    client = MlflowClient(f"sqlite:///{db}")

    def artifact(run_id: str) -> Ledger:
        return Ledger.loads(Path(client.download_artifacts(run_id, "ledger.jsonl", str(tmp_path / "dl"))).read_text())

    def record(s, step: int, first_id: int) -> None:  # a step of one prompt's 8 samples, as relax-verify-run expects
        s.log({"perf/step_time": 1.0, "rollout/reward_dropped_frac": 0.0}, step)
        s.record_samples(step, torch.arange(first_id, first_id + 8), torch.ones(8, dtype=torch.bool))

    cluster = RecordingCluster(f"sqlite:///{db}")
    small = ["rollout.rollout_batch_size=1", "train.global_batch_size=8"]
    ckpts, session = _session(["train.num_rollout=3", *small], tmp_path, db)
    with ckpts, session() as s:
        for step in range(3):
            record(s, step, 8 * step)
            if step:
                s.save_checkpoint(cluster, step + 1, {"sampler": {}})
        run_id = s.tracker.run_id
    trained = artifact(run_id)
    assert trained.steps == [0, 1, 2]
    step2 = checkpoint.step_dir(ckpts.save_dir, 2)

    ckpts, session = _session([f"train.resume={step2}", "train.num_rollout=0", *small], tmp_path, db)
    with ckpts, session() as s:
        s.log_evaluation({"eval/digits/mean_at_1": 0.5}, 2, evaluation_only=True)
    assert artifact(run_id).entries == trained.entries  # was: checkpoint 2's ledger, steps 0 and 1

    report = verify_run.verify(run_id, f"sqlite:///{db}")
    assert report.ok, report.text()

    ckpts, session = _session([f"train.resume={step2}", "train.num_rollout=4", *small], tmp_path, db)
    with ckpts, session() as s:
        record(s, 2, 24)  # step 2 again: the first job's drew ids 16..23, this one the next prompt's
        s.save_checkpoint(cluster, 3, {"sampler": {}})
        record(s, 3, 32)
        s.save_checkpoint(cluster, 4, {"sampler": {}})
    assert artifact(run_id).entries == s.ledger.entries and s.ledger.steps == [0, 1, 2, 3]
    assert artifact(run_id).entries[:2] == trained.entries[:2]
    report = verify_run.verify(run_id, f"sqlite:///{db}")
    assert report.ok, report.text()
    tags = client.get_run(run_id).data.tags
    assert tags["relax.resumed.1"].startswith(f"step 2 from {step2}; changed: train.num_rollout: 3 -> 0")
    assert tags["relax.resumed.2"] == tags["relax.resumed"] == \
        f"step 2 from {step2}; changed: train.num_rollout: 3 -> 4"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_an_evaluation_sweeps_job_keeps_the_arm_of_the_training_run_it_reopens(tmp_path, mlflow_template, monkeypatch):
    """docs/experiments.md, step 4: a job of an evaluation sweep of a checkpoint (relax-train -m -cp <checkpoint> -cn
    config train.resume=<checkpoint> train.num_rollout=0 ...) reopens the training run, a job of another sweep. Its
    config is the training job's saved one with the new sweep's tracking.sweep_id and tracking.parent_run_id, and no
    tracking.arm of its own (the launcher derives none for a job that continues a checkpoint; a resume may not change
    it). The reopened run's standard tags are set again from that config, so its arm and seed stay the training
    job's; the run moves to the evaluation sweep (sweep_id, parent, and the relax.sweep_job that MLflow's run context
    names for the job), the old sweep and parent kept as relax.previous_*."""
    import json

    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    shutil.copyfile(mlflow_template, db)
    client = MlflowClient(f"sqlite:///{db}")
    experiment = client.create_experiment("relax", artifact_location=str(tmp_path / "artifacts"))  # not ./mlruns
    first, evaluation = (client.create_run(experiment, tags={"sweep_id": s}).info.run_id for s in ("S1", "S2"))
    job = ["seed=1", "train.lr=0.01", "tracking.arm='train.lr=0.01'"]  # a job of -m train.lr=0.01,0.001 seed=1
    monkeypatch.setenv("MLFLOW_RUN_CONTEXT", json.dumps({"relax.sweep_job": "S1/0"}))  # as the launcher sets it
    ckpts, session = _session([*job, "train.num_rollout=2", "tracking.sweep_id=S1",
                               f"tracking.parent_run_id={first}"], tmp_path, db)
    with ckpts, session() as s:
        for step in range(2):
            s.log({"rollout/raw_reward": 0.1 * step}, step)
        s.save_checkpoint(RecordingCluster(f"sqlite:///{db}"), 2, {"sampler": {}})
        run_id = s.tracker.run_id
    trained = client.get_run(run_id).data.tags
    assert (trained["arm"], trained["sweep_id"], trained["relax.sweep_job"]) == ("train.lr=0.01", "S1", "S1/0")

    step2 = checkpoint.step_dir(ckpts.save_dir, 2)
    monkeypatch.setenv("MLFLOW_RUN_CONTEXT", json.dumps({"relax.sweep_job": "S2/1"}))
    ckpts, session = _session([*job, f"train.resume='{step2}'", "train.num_rollout=0", "tracking.sweep_id=S2",
                               f"tracking.parent_run_id={evaluation}"], tmp_path, db)
    with ckpts, session() as s:
        s.log_evaluation({"eval/digits/mean_at_1": 0.5}, 2, evaluation_only=True)
        assert s.tracker.run_id == run_id
    tags = client.get_run(run_id).data.tags
    assert {k: tags[k] for k in STANDARD_TAG_KEYS} == {k: trained[k] for k in STANDARD_TAG_KEYS}
    assert (tags["sweep_id"], tags["mlflow.parentRunId"], tags["relax.sweep_job"]) == ("S2", evaluation, "S2/1")
    assert (tags["relax.previous_sweep_id"], tags["relax.previous_parent_run_id"]) == ("S1", first)
    assert [m.value for m in client.get_metric_history(run_id, "eval/digits/mean_at_1")] == [0.5]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_job_killed_before_its_first_checkpoint_does_not_stay_running(tmp_path, mlflow_template):
    import atexit

    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    shutil.copyfile(mlflow_template, db)
    ckpts, session = _session([], tmp_path, db)
    ckpts.__enter__()
    killed = session().__enter__()
    killed.log({"x": 1.0}, 0)
    atexit.unregister(killed.tracker._at_exit)  # kill -9: nothing closes the run; the kernel drops the lock
    ckpts.__exit__(None, None, None)
    client = MlflowClient(f"sqlite:///{db}")
    assert client.get_run(killed.tracker.run_id).info.status == "RUNNING"

    ckpts2, session2 = _session(["train.resume=auto"], tmp_path, db)  # nothing to resume: a fresh start
    with ckpts2, session2() as s:
        assert ckpts2.resume is None and s.tracker.run_id != killed.tracker.run_id
        assert client.get_run(killed.tracker.run_id).info.status == "KILLED"
    assert client.get_run(s.tracker.run_id).info.status == "FINISHED"


# ------------------------------------------------------------------------------ kill -9, then resume=auto

STEPS = 6
PER_STEP = 2 * 4  # reward calls per step: rollout_batch_size * n_samples_per_prompt
# hybrid: the rollout of step k + 1 is generated (with the weights of step k) while step k trains, so a checkpoint
# holds a batch generated ahead, which the resumed run must train exactly as the uninterrupted one does
RUN_ARGS = [f"train.num_rollout={STEPS}", "train.save_interval=2", "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=4", "tracking.progress=false",
            "data=guess_number", "rollout.max_turns=2", "rollout.max_episode_tokens=20",
            # the environment's reward plus this one's on the last message, one call per episode
            "data.reward=hold_reward:reward",
            "data.reward_timeout_s=null",  # the reward runs in the driver: its call count holds the run
            "train.mode=hybrid",
            "cluster.cpus_per_node=1"]  # one torch thread in every role: the reference computes the same floats
KEY = "train/loss"
HERE = Path(__file__).resolve().parent  # hold_reward.py


def _start(cwd: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    with open(cwd / f"log-{len(list(cwd.glob('log-*')))}.txt", "w") as log:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-m", "relax.cli.train", *RUN_ARGS,
                                 f"tracking.uri=sqlite:///{cwd}/mlflow.db", *extra],
                                cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})


def _log_text(cwd: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(cwd.glob("log-*.txt")))[-4000:]


def _committed_step(save_dir: Path) -> int:
    """The highest committed step in save_dir (a step_* directory with its state.json), 0 if none."""
    steps = [int(p.name[len("step_"):]) for p in save_dir.glob("step_*") if (p / "state.json").is_file()]
    return max(steps, default=0)


def _durable_steps(db: Path) -> dict[str, list[int]]:
    """(key -> steps) as the store holds them, read with sqlite directly (no MLflow code involved)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as con:
        rows = con.execute("SELECT key, step FROM metrics").fetchall()
    out: dict[str, list[int]] = {}
    for key, step in rows:
        out.setdefault(key, []).append(step)
    return out


def _descendants(pid: int) -> dict[int, tuple[str, str]]:
    """pid -> (start time, command line) of every process below `pid`, from /proc."""
    parent, info = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        parent[int(entry.name)] = int(fields[1])
        info[int(entry.name)] = (fields[19], cmd)
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                found[child] = info[child]
                frontier.append(child)
    return found


def _alive(pid: int, start: str) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[19] == start and fields[0] != "Z"


def _weights(save_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(save_dir / f"step_{STEPS:06d}" / "policy" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # SQLAlchemy's, from MLflow's store
def test_kill_9_then_resume_auto_equals_an_uninterrupted_run(tmp_path, mlflow_template, monkeypatch, capfd):
    import torch
    from inprocess_ray import inprocess_ray
    from mlflow import MlflowClient

    from relax.runner.train import run

    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    for d in (ref_dir, run_dir):
        d.mkdir()
        shutil.copyfile(mlflow_template, d / "mlflow.db")
    save_dir = run_dir / "checkpoints" / "relax" / "grpo-seed1"  # the default location: no train.save_dir given
    ray_procs: dict[int, tuple[str, str]] = {}
    # The run to kill: its reward function holds it at the first reward call of the rollout of step 4. Hybrid
    # generates that rollout on weights version 3 (published once step 2 has trained) and scores it in the stream's
    # pump while step 3 trains; step 3 is logged, and the checkpoint of step 4 that follows waits for the pump,
    # held in scoring. Metrics reach the store every 0.2 s, so steps 2 and 3 are recorded in MLflow but not covered
    # by a checkpoint (the last is step 2's) when the kill comes: the resume recomputes them. Whether step 4's
    # batch is generated and its scoring begun before step 3 ends depends on the machine's load, so a barrier
    # (HOLD_CHECKPOINT) holds the checkpoint of step 4 until the held call is reached: it then always waits for
    # the pump. (Without it a loaded machine wrote that checkpoint first, and the kill found step 4 committed.)
    held = run_dir / "held"
    proc = _start(run_dir, env={"RELAX_MLFLOW_FLUSH_S": "0.2", "HOLD_AT_CALL": str(4 * PER_STEP),
                                "HOLD_FILE": str(held), "HOLD_CHECKPOINT": "4"})
    try:
        # meanwhile, the same run uninterrupted, its roles in this process (what it computes is what is compared)
        with monkeypatch.context() as here, inprocess_ray():
            here.chdir(ref_dir)
            run(load_config([*RUN_ARGS, f"tracking.uri=sqlite:///{ref_dir}/mlflow.db"]), output_dir=ref_dir / "out")
        # ---- kill -9 once step 3 is in MLflow, between the checkpoints of steps 2 and 4
        deadline = time.monotonic() + 400
        while not held.exists() or 3 not in _durable_steps(run_dir / "mlflow.db").get(KEY, []):
            assert proc.poll() is None, "the run ended before it could be killed:\n" + _log_text(run_dir)
            assert time.monotonic() < deadline, "not held at step 4 within the time limit:\n" + _log_text(run_dir)
            time.sleep(0.1)
        ray_procs = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        killed_at = _committed_step(save_dir)
        assert killed_at == 2
        before = _durable_steps(run_dir / "mlflow.db")
        assert sorted(before[KEY]) == [0, 1, 2, 3]  # steps 2 and 3 are recorded though no checkpoint covers them
        with sqlite3.connect(run_dir / "mlflow.db") as con:
            [(run_id, status)] = con.execute("SELECT run_uuid, status FROM runs").fetchall()
        assert status == "RUNNING"  # what kill -9 leaves; the resume reopens this run

        # ---- Ray's processes die with the driver that started it: raylet, GCS, the roles (the raylet's workers)
        assert any("raylet" in cmd for _, cmd in ray_procs.values()), ray_procs
        assert any("ray::PolicyWorker" in cmd for _, cmd in ray_procs.values()), ray_procs  # the actor role
        agents = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # see the finally clause
        ray_core = {pid: v for pid, v in ray_procs.items() if not v[1].startswith(agents)}
        until = time.monotonic() + 30
        while any(_alive(pid, start) for pid, (start, _) in ray_core.items()) and time.monotonic() < until:
            time.sleep(0.5)
        assert not [v[1][:80] for pid, v in ray_core.items() if _alive(pid, v[0])]

        # ---- resume=auto, to the end: the same run again in its directory (its roles in this process, like the
        # reference; what a resume restores and recomputes is the runner's, whatever carries the calls)
        with monkeypatch.context() as here, inprocess_ray():
            here.chdir(run_dir)
            run(load_config([*RUN_ARGS, f"tracking.uri=sqlite:///{run_dir}/mlflow.db", "train.resume=auto"]),
                output_dir=run_dir / "out")
        assert f"resuming from {save_dir}/step_{killed_at:06d}" in capfd.readouterr().err
    finally:
        if proc.poll() is None:
            proc.kill()
        # Ray's two agents (dashboard, runtime env) exit on their own once they notice the raylet is gone,
        # which takes up to a minute (Ray's timeout on reporting it); do not leave them behind in CI
        for pid, (start, _) in ray_procs.items():
            if _alive(pid, start):
                os.kill(pid, signal.SIGKILL)

    # ---- one MLflow run, FINISHED, every step of every metric exactly once
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.info.run_id, r.info.status) for r in runs] == [(run_id, "FINISHED")]
    assert runs[0].data.tags["relax.resumed"] == f"step 2 from {save_dir}/step_000002"
    ref_client = MlflowClient(f"sqlite:///{ref_dir}/mlflow.db")
    [ref_run] = ref_client.search_runs([e.experiment_id for e in ref_client.search_experiments()])
    keys = set(ref_run.data.metrics)
    assert set(runs[0].data.metrics) == keys and KEY in keys
    for key in sorted(keys):
        history = client.get_metric_history(run_id, key)
        if key.startswith(SYSTEM_PREFIX):  # sampled in time, with steps of their own (docs/experiments.md)
            assert len({m.step for m in history}) == len(history), key  # each sample once across the kill
            continue
        assert Counter(m.step for m in history) == Counter(range(STEPS)), key
        if key.startswith("perf/"):
            continue  # times
        ref_values = {m.step: m.value for m in ref_client.get_metric_history(ref_run.info.run_id, key)}
        for m in history:
            assert m.value == pytest.approx(ref_values[m.step], rel=1e-6, abs=1e-7), (key, m.step)
    assert json.loads((save_dir / f"step_{STEPS:06d}" / "state.json").read_text())["mlflow_run_id"] == run_id
    # ---- the ledger: no trained episode lost, none trained twice
    from relax.cli import verify_run

    assert verify_run.main([run_id, "--uri", f"sqlite:///{run_dir}/mlflow.db"]) == 0

    # ---- the same final weights as the uninterrupted run
    ref_weights, weights = _weights(ref_dir / "checkpoints" / "relax" / "grpo-seed1"), _weights(save_dir)
    assert ref_weights.keys() == weights.keys()
    for name, tensor in ref_weights.items():
        assert torch.allclose(weights[name], tensor, rtol=0, atol=1e-6), name
    assert [p.name for p in save_dir.iterdir() if p.name.startswith(".tmp-")] == []
    assert len(list(save_dir.glob("step_*"))) == 2  # train.keep_checkpoints=2
