"""`relax-verify-run`: the run invariants (every step trained once, no sample trained twice, every step's metrics
recorded exactly once, the checkpoint's ledger the start of the run's) as checks, and as the command on real runs.

The checks are tried on hand-built ledgers and metric histories (each must fail on its violation); the command on a
hand-built MLflow record (no store), on a checkpoint of a run without tracking, and end to end on a real run on
Ray with a sqlite store, continued from an earlier checkpoint with a resume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax.cli import verify_run
from relax.config import load_config
from relax.metrics import LOSS, REWARD_DROPPED_FRAC, STEP_TIME
from relax.runner import checkpoint
from relax.runner.checkpoint import Checkpoints
from relax.runner.ledger import (
    FILE,
    Ledger,
    LedgerError,
    check_dropped,
    check_prefix,
    check_samples,
    check_steps,
    to_ranges,
)
from relax.tracking.verify import RunRecord, check_metric_steps, completed_steps, read_run

B, G = 4, 4  # the runs' rollout_batch_size and n_samples_per_prompt
PER_STEP = B * G
PARAMS = {verify_run.BATCH_PARAM: str(B), verify_run.GROUP_PARAM: str(G)}


def good_ledger(steps: int = 3, left_out_step: int | None = 1) -> Ledger:
    """Steps as the rollout stream draws them: step s has ids s*16..s*16+15; one group left out at `left_out_step`."""
    ledger = Ledger()
    for s in range(steps):
        ids = torch.arange(s * PER_STEP, (s + 1) * PER_STEP)
        kept = torch.ones(PER_STEP, dtype=torch.bool)
        if s == left_out_step:
            kept[G:2 * G] = False
        ledger.add(s, ids, kept)
    return ledger


def histories(steps: int, every=(STEP_TIME, REWARD_DROPPED_FRAC, LOSS)) -> dict[str, list[int]]:
    return {key: list(range(steps)) for key in every}


# ------------------------------------------------------------------------------------------ the ledger


def test_ledger_round_trip_keeps_ranges_and_duplicates():
    assert to_ranges([5, 3, 4, 9, 7, 8]) == ((3, 6), (7, 10))
    assert to_ranges([5, 6, 6, 7]) == ((5, 7), (6, 8))  # a duplicate id stays visible as overlapping ranges
    ledger = good_ledger()
    text = ledger.dumps()
    assert text.splitlines()[1] == '{"step":1,"trained":[[16,20],[24,32]],"left_out":[[20,24]]}'
    assert Ledger.loads(text).entries == ledger.entries
    assert Ledger.loads(text).truncate(2).steps == [0, 1] and ledger.before(1).steps == [0]


@pytest.mark.parametrize("line, problem", [
    ("not json", "line 2: not JSON"),
    ('{"step": -1, "trained": [], "left_out": []}', "line 2: not an entry"),
    ('{"step": 1, "trained": [[5, 3]], "left_out": []}', "line 2: 'trained' holds [5, 3]"),
    ('{"step": 1, "trained": [], "left_out": 7}', "line 2: 'left_out' is not a list"),
])
def test_a_damaged_ledger_is_refused_naming_the_line(line, problem):
    with pytest.raises(LedgerError, match="^" + re.escape(f"ledger.jsonl, {problem}")):
        Ledger.loads(good_ledger(1).dumps() + line + "\n", "ledger.jsonl")


def test_a_good_ledger_passes():
    ledger = good_ledger()
    assert check_steps(ledger.steps, 3, "the ledger") == []
    assert check_samples(ledger, PER_STEP) == []
    assert check_dropped(ledger, {0: 0.0, 1: 0.25, 2: 0.0}) == []
    assert check_prefix(ledger.before(2), 2, ledger) == []


def test_a_sample_trained_in_two_steps_fails():
    ledger = good_ledger(2)
    ledger.add(2, torch.arange(28, 44), torch.ones(16, dtype=torch.bool))  # 28..31 were trained at step 1
    assert check_samples(ledger, PER_STEP) == ["sample ids 28..31 trained twice: trained at step 2 and trained at "
                                               "step 3"]


def test_a_sample_twice_in_one_step_or_trained_after_being_left_out_fails():
    ledger = Ledger()
    ledger.add(0, torch.tensor([0, 1, 2, 2]), torch.ones(4, dtype=torch.bool))
    assert check_samples(ledger) == ["sample id 2 trained twice: trained at step 1 and trained at step 1"]
    ledger = good_ledger(2)  # ids 20..23 were left out at step 1
    ledger.add(2, torch.arange(20, 24), torch.ones(4, dtype=torch.bool))
    assert check_samples(ledger) == ["sample ids 20..23 used twice: left out at step 2 and trained at step 3"]


def test_samples_set_aside_by_dynamic_sampling_are_recorded_and_never_trained_elsewhere():
    ledger = good_ledger(1)
    ledger.add(1, torch.arange(16, 32), torch.ones(16, dtype=torch.bool), set_aside=torch.arange(32, 40))
    text = ledger.dumps()
    assert text.splitlines()[1] == '{"step":1,"trained":[[16,32]],"left_out":[],"set_aside":[[32,40]]}'
    assert '"set_aside"' not in text.splitlines()[0]  # written only when there are some
    again = Ledger.loads(text)
    assert again.entries == ledger.entries and again.entries[1].size == PER_STEP  # not part of the batch
    assert check_samples(again, PER_STEP) == []
    again.add(2, torch.arange(36, 52), torch.ones(16, dtype=torch.bool))  # 36..39 were set aside at step 1
    assert check_samples(again, PER_STEP) == ["sample ids 36..39 used twice: set aside at step 2 and trained at "
                                              "step 3"]


def test_a_missing_or_repeated_step_and_a_wrong_batch_fail():
    ledger = good_ledger(4)
    ledger.entries.pop(2)
    assert check_steps(ledger.steps, 4, "the ledger") == ["the ledger is missing step 3 (MLflow step 2) of its 4"]
    ledger = good_ledger(3)
    ledger.entries.append(ledger.entries[1])
    problems = check_steps(ledger.steps, 3, "the ledger")
    assert problems == ["the ledger has step 2 (MLflow step 1) more than once"]
    assert check_steps([0, 1, 2, 3], 2, "the ledger") == [
        "the ledger has steps 3..4 (MLflow steps 2..3) beyond the run's 2 steps"]
    short = Ledger()
    short.add(0, torch.arange(12), torch.ones(12, dtype=torch.bool))
    assert check_samples(short, PER_STEP) == ["step 1 has 12 samples (12 trained, 0 left out), expected 16"]


def test_a_ledger_that_disagrees_with_the_logged_dropped_share_fails():
    assert check_dropped(good_ledger(), {1: 0.0}) == [
        "step 2: the ledger leaves out 4 of 16 samples (0.25) but the run logged a dropped share of 0"]


def test_the_checkpoint_ledger_must_start_the_runs():
    run = good_ledger(3)
    other = good_ledger(2, left_out_step=None)  # step 1 trained everything here
    assert check_prefix(other, 2, run) == ["step 2 (MLflow step 1) differ between the checkpoint's ledger and "
                                         "the run's"]
    assert check_prefix(good_ledger(4), 4, run) == ["step 4 (MLflow step 3) of the checkpoint's ledger are not "
                                                      "in the run's"]
    assert check_prefix(run.before(1), 2, run) == [
        "the ledger of the checkpoint of step 2 is missing step 2 (MLflow step 1) of its 2"]


# ------------------------------------------------------------------------------------------- metrics


def test_metric_histories():
    every = (STEP_TIME, REWARD_DROPPED_FRAC)
    good = histories(3)
    good["eval/reward"] = [1]  # logged at some steps only: at most once each
    assert completed_steps(good, every) == 3
    assert check_metric_steps(good, 3, every) == []
    twice = {**good, LOSS: [0, 1, 1, 2]}
    assert check_metric_steps(twice, 3, every) == [
        f"metric {LOSS} is recorded more than once at step 2 (MLflow step 1)"]
    gap = {**good, STEP_TIME: [0, 2]}
    assert check_metric_steps(gap, 3, every) == [
        f"metric {STEP_TIME} (logged at every step) is missing step 2 (MLflow step 1)"]
    assert f"metric {LOSS} is recorded at step 3 (MLflow step 2), outside the run's 2 steps" in check_metric_steps(
        good, 2, every)
    # an evaluation-only run of the run's end logs its evaluation at step n (relax.runner.train: the checkpoint's
    # step); only an evaluation may be there
    assert check_metric_steps({**good, "eval/digits/mean_reward": [1, 3]}, 3, every) == []
    assert check_metric_steps({**good, "eval/digits/mean_reward": [4]}, 3, every) == [
        "metric eval/digits/mean_reward is recorded at MLflow step(s) 4, outside the run's MLflow steps 0..3"]
    absent = {k: v for k, v in good.items() if k != REWARD_DROPPED_FRAC}
    assert check_metric_steps(absent, 3, every) == [
        f"metric {REWARD_DROPPED_FRAC} (logged at every step) is not in the run"]


# ----------------------------------------------------------------- the command on a hand-built MLflow record


def record(status: str = "FINISHED", steps: int = 3, ledger: Ledger | None = None, **changes) -> RunRecord:
    hist = {k: [(s, 0.0) for s in v] for k, v in histories(steps).items()}
    hist[REWARD_DROPPED_FRAC] = [(s, 0.25 if s == 1 else 0.0) for s in range(steps)]
    hist.update(changes)
    text = (ledger if ledger is not None else good_ledger(steps)).dumps()
    return RunRecord("r1", "sqlite:///x.db", status, dict(PARAMS), {}, hist, text)


def verify_record(monkeypatch, rec: RunRecord, capsys) -> tuple[int, str]:
    monkeypatch.setattr(verify_run, "read_run", lambda uri, run_id, artifact: rec)
    code = verify_run.main(["r1", "--uri", "sqlite:///x.db"])
    return code, capsys.readouterr().out


def test_the_command_passes_a_good_run_and_fails_each_violation(monkeypatch, capsys):
    code, out = verify_record(monkeypatch, record(), capsys)
    assert code == 0, out
    assert "ledger          3 steps, 44 samples trained, 4 left out" in out and out.rstrip().endswith("a step")
    # its steps as the progress line counts them (step 1/3 .. 3/3), then as MLflow numbers their metrics
    assert "  steps           3: steps 1..3 (MLflow steps 0..2)" in out

    code, out = verify_record(monkeypatch, record(**{LOSS: [(0, 1.0), (1, 1.0), (1, 2.0), (2, 1.0)]}), capsys)
    assert code == 1 and f"  - metric {LOSS} is recorded more than once at step 2 (MLflow step 1)" in out

    gap = good_ledger(3)
    gap.entries.pop(1)
    code, out = verify_record(monkeypatch, record(ledger=gap), capsys)
    assert code == 1 and "  - the run's ledger is missing step 2 (MLflow step 1) of its 3" in out

    dup = good_ledger(2)
    dup.add(2, torch.arange(0, 16), torch.ones(16, dtype=torch.bool))
    code, out = verify_record(monkeypatch, record(ledger=dup), capsys)
    assert code == 1 and "  - sample ids 0..15 trained twice: trained at step 1 and trained at step 3" in out

    code, out = verify_record(monkeypatch, record(ledger=Ledger()), capsys)  # finished, yet no step in the ledger
    assert code == 1 and "the run's ledger is missing steps 1..3 (MLflow steps 0..2) of its 3" in out

    rec = record()
    rec.artifact = None
    code, out = verify_record(monkeypatch, rec, capsys)
    assert code == 1 and f"the run has no {FILE} artifact" in out


def test_a_running_run_may_have_metrics_ahead_of_its_ledger(monkeypatch, capsys):
    """The artifact is rewritten at each checkpoint: a run still going (or killed with kill -9) has later steps in
    MLflow only. A finished run may not."""
    code, out = verify_record(monkeypatch, record("RUNNING", steps=5, ledger=good_ledger(3)), capsys)
    assert code == 0, out
    assert "note: the run is RUNNING: steps 4..5 (MLflow steps 3..4) are in MLflow but not yet in its ledger" in out
    code, out = verify_record(monkeypatch, record("FINISHED", steps=5, ledger=good_ledger(3)), capsys)
    assert code == 1 and "the run's ledger is missing steps 4..5 (MLflow steps 3..4) of its 5" in out
    early = record("RUNNING", steps=1)
    early.artifact = None  # before its first checkpoint
    code, out = verify_record(monkeypatch, early, capsys)
    assert code == 0 and f"note: the run is RUNNING and has no {FILE} artifact yet" in out


def test_an_evaluation_only_run_is_reported_as_one_evaluation(monkeypatch, capsys):
    """train.num_rollout=0: no step, sample or checkpoint lines (the run has none), its eval metrics and their step;
    a training metric or a second value of an eval metric at its step still fails it."""
    evals = {f"eval/digits/{m}": [(0, 0.5)] for m in ("mean_at_4", "pass_at_1", "pass_at_4")}
    rec = RunRecord("r1", "sqlite:///x.db", "FINISHED", {**PARAMS, "train.num_rollout": "0"}, {}, dict(evals), "")
    code, out = verify_record(monkeypatch, rec, capsys)
    assert code == 0, out
    assert out.splitlines()[1:] == [
        "  evaluation only  3 eval metrics at step 0 (train.num_rollout=0: no step trained)",
        "OK: evaluation only, every eval metric recorded once and no training metric"]
    # of a checkpoint: at its step
    at_two = RunRecord("r1", "sqlite:///x.db", "FINISHED", {**PARAMS, "train.num_rollout": "0"}, {},
                       {k: [(2, 0.5)] for k in evals}, None)
    code, out = verify_record(monkeypatch, at_two, capsys)
    assert code == 0 and "3 eval metrics at step 2" in out
    bad = RunRecord("r1", "sqlite:///x.db", "FINISHED", {**PARAMS, "train.num_rollout": "0"}, {},
                    {**evals, "eval/digits/pass_at_1": [(0, 0.5), (0, 0.25)], STEP_TIME: [(0, 1.0)]},
                    good_ledger(1).dumps())
    code, out = verify_record(monkeypatch, bad, capsys)
    assert code == 1
    assert "  - metric eval/digits/pass_at_1 is recorded more than once at MLflow step(s) 0" in out
    assert f"  - metric {STEP_TIME} is recorded at step 1 (MLflow step 0), outside the run's 0 steps" in out
    assert f"  - the run's {FILE} records trained step 1 (MLflow step 0), but an evaluation-only run trains none" in out
    # the control: the same metrics on a training run's record are judged as steps (step_time missing, ...)
    code, out = verify_record(monkeypatch, RunRecord("r1", "sqlite:///x.db", "FINISHED", dict(PARAMS), {},
                                                     dict(evals), ""), capsys)
    assert "evaluation only" not in out and "samples a step" in out


def test_usage_errors_name_what_is_missing(tmp_path, capsys):
    assert verify_run.main(["--uri", f"sqlite:///{tmp_path}/none.db", "abc123"]) == 2
    assert capsys.readouterr().err == (f"relax-verify-run: error: no tracking store at sqlite:///{tmp_path}/none.db "
                                       "(run from the directory of your runs, or pass --uri)\n")
    assert verify_run.main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"relax-verify-run: error: {tmp_path}/nowhere: no such directory\n"
    assert verify_run.main([str(tmp_path)]) == 2
    assert "no checkpoint in" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_sweeps_parent_run_is_named_as_such_with_its_jobs_runs(tmp_path, capsys, mlflow_template):
    """The id a sweep prints first is its parent run's (`Sweep ...: 2 jobs, MLflow parent run <id>`), which has no
    steps: relax-verify-run says so and names the jobs' runs to verify (exit 2, nothing to check). Before, it
    reported `steps 0`, `metrics 0 keys, ... logged at every step` and failed (exit 1) on a missing ledger, as if a
    training run had lost it. Control: a job's run is verified as a run (its missing ledger is its violation)."""
    from mlflow import MlflowClient

    shutil.copyfile(mlflow_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("relax")
    # as the sweep launcher makes them: the parent tagged sweep_id and overrides; each job's run nested under it
    parent = client.create_run(exp, run_name="sweep-s1", tags={"sweep_id": "s1", "overrides": "seed=1,2"}).info.run_id
    jobs = []
    for index, status in ((0, "FINISHED"), (1, "KILLED")):
        run = client.create_run(exp, tags={"mlflow.parentRunId": parent, "sweep_id": "s1",
                                           "relax.sweep_job": f"s1/{index}"}).info.run_id
        client.log_metric(run, STEP_TIME, 1.0, step=0)
        client.set_terminated(run, status)
        jobs.append(run)
    client.set_terminated(parent, "FINISHED")
    assert verify_run.main([parent, "--uri", uri]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        f"relax-verify-run: error: MLflow run {parent} is the parent run of sweep s1: it has no steps of its own (each "
        f"job of the sweep trains in a run of its own); verify its jobs' runs, e.g. relax-verify-run {jobs[0]}:",
        f"  {jobs[0]}  FINISHED  job 0",
        f"  {jobs[1]}  KILLED  job 1"]
    # control: a job's run is a run to verify
    assert verify_run.main([jobs[0], "--uri", uri]) == 1
    assert f"the run has no {FILE} artifact" in capsys.readouterr().out
    # a parent whose jobs opened no run
    lonely = client.create_run(exp, tags={"sweep_id": "s2"}).info.run_id
    assert verify_run.main([lonely, "--uri", uri]) == 2
    assert capsys.readouterr().err.rstrip().endswith(f"and no run in {uri} is nested under it (no job opened one)")


# --------------------------------------------------------- the session: the ledger in checkpoints, and resume


class FakeCluster:
    """Cluster.save without Ray: the roles' files, then the commit (which adds the ledger)."""

    def save(self, ckpts: Checkpoints, step: int, state: dict, rollout: dict | None = None) -> Path:
        staging = ckpts.staging(step)
        (staging / "policy").mkdir()
        (staging / "policy" / "model.safetensors").write_text(f"w{step}")
        return ckpts.commit(staging, step, state)


def _session(tmp_path: Path, *overrides: str):
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    cfg = load_config(["tracking.enabled=false", "tracking.progress=false", f"train.save_dir={tmp_path}/ckpt",
                       f"rollout.rollout_batch_size={B}", f"rollout.n_samples_per_prompt={G}", *overrides])
    ckpts = Checkpoints(cfg, tmp_path)
    return ckpts, lambda: Session(cfg, build_plan(cfg), tmp_path / "out", checkpoints=ckpts)


def test_the_ledger_goes_into_each_checkpoint_and_a_resume_continues_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ledger = good_ledger(4)
    ckpts, session = _session(tmp_path)
    with ckpts, session() as s:
        for e in ledger.entries[:3]:
            ids = [i for a, b in e.trained + e.left_out for i in range(a, b)]
            kept = [any(a <= i < b for a, b in e.trained) for i in ids]
            s.record_samples(e.step, torch.tensor(ids), torch.tensor(kept))
            if e.step == 1:
                s.save_checkpoint(FakeCluster(), 2, {"sampler": {}})
    path = tmp_path / "ckpt" / "step_000002"
    state = json.loads((path / checkpoint.STATE).read_text())
    assert FILE in state[checkpoint.FILES]  # in the manifest: a resume checks it
    assert Ledger.read(path / FILE).entries == ledger.entries[:2]  # steps before the checkpoint's only

    # resumed from step 2: steps 0-1 from the checkpoint, step 2 computed again, then step 3
    ckpts, session = _session(tmp_path, "train.resume=auto")
    with ckpts, session() as s:
        assert s.ledger.entries == ledger.entries[:2]
        for step in (2, 3):
            s.record_samples(step, torch.arange(step * PER_STEP, (step + 1) * PER_STEP),
                             torch.tensor([not (step == 1 and G <= i < 2 * G) for i in range(PER_STEP)]))
        s.save_checkpoint(FakeCluster(), 4, {"sampler": {}})
    capsys.readouterr()
    assert verify_run.main([str(tmp_path / "ckpt")]) == 0  # no MLflow run: the checkpoint's ledger only
    out = capsys.readouterr().out
    assert "(no MLflow run: tracking was off)" in out and "4 steps, 60 samples trained, 4 left out" in out

    # a ledger changed after the commit is refused, by resume and by relax-verify-run
    (tmp_path / "ckpt" / "step_000004" / FILE).write_text(ledger.before(3).dumps())
    assert verify_run.main([str(tmp_path / "ckpt")]) == 1
    assert f"{FILE} was changed after checkpoint" in capsys.readouterr().out
    from relax.runner.errors import RunError

    with pytest.raises(RunError, match=f"{FILE} is damaged"):
        with Checkpoints(load_config(["train.resume=auto", f"train.save_dir={tmp_path}/ckpt",
                                      "tracking.enabled=false", f"rollout.rollout_batch_size={B}",
                                      f"rollout.n_samples_per_prompt={G}"]), tmp_path):
            pass


# ------------------------------------------------------------------------ end to end: Ray, MLflow, resume


def _verify_subprocess(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """relax-verify-run as a user runs it (the installed script, else the module), with relax-train's default store
    in `cwd`."""
    script = shutil.which("relax-verify-run")
    cmd = [script] if script else [sys.executable, "-m", "relax.cli.verify_run"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_real_run_and_its_resume_verify(in_process, small_run, tmp_path, monkeypatch):
    from relax.runner.train import run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    # a run of 2 steps, a checkpoint after each
    first = run(load_config(small_run("train.save_interval=1", steps=2)), output_dir=tmp_path / "out")
    report = verify_run.verify(first.run_id, uri)
    assert report.ok, report.text()
    ckpt = tmp_path / "ckpt"
    assert Ledger.read(ckpt / "step_000001" / FILE).steps == [0]

    # continued from the checkpoint of step 1, as after a kill once step 1 was in MLflow but not in a checkpoint:
    # step 1 is computed again (its metrics are not written twice), its ledger entry replaced, in the same MLflow run
    resumed = run(load_config(small_run("train.save_interval=1", f"train.resume={ckpt}/step_000001", steps=2)),
                  output_dir=tmp_path / "out")
    assert resumed.run_id == first.run_id
    done = _verify_subprocess(tmp_path, first.run_id)  # the store: relax-train's default, sqlite:///mlflow.db in cwd
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"relax-verify-run: MLflow run {first.run_id} (FINISHED) in {uri}"
    assert "  steps           2: steps 1..2 (MLflow steps 0..1)" in lines
    assert f"  samples a step  {PER_STEP} (rollout.rollout_batch_size={B} x rollout.n_samples_per_prompt={G})" in lines
    assert f"  checkpoint      {ckpt}/step_000002 (step 2): its ledger starts the run's" in lines
    assert lines[-1].startswith("OK: ")
    print(done.stdout)

    ledger = Ledger.loads(read_run(uri, first.run_id, FILE).artifact)
    assert ledger.steps == [0, 1] and sum(e.size for e in ledger.entries) == 2 * PER_STEP
    assert verify_run.main([str(ckpt)]) == 0  # the save dir: its latest checkpoint and the run it names


@pytest.mark.slow  # two MLflow stores made (about 10 s)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_checkpoint_names_its_store_from_any_directory(tmp_path, capsys, monkeypatch):
    """relax-train's default store, sqlite:///mlflow.db, is relative to where it ran. The checkpoint keeps the store
    the run resolved, so `relax-verify-run <checkpoint>` from another directory checks the run where it is (it
    looked for ./mlflow.db and stopped: "no tracking store"), and a resume from another directory names it."""
    from relax.runner.errors import RunError
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    runs.mkdir(), elsewhere.mkdir()
    overrides = ["tracking.uri=sqlite:///mlflow.db", "tracking.progress=false", "tracking.system_metrics=false",
                 f"train.save_dir={tmp_path}/ckpt", f"rollout.rollout_batch_size={B}",
                 f"rollout.n_samples_per_prompt={G}", "train.num_rollout=2"]
    monkeypatch.chdir(runs)
    cfg = load_config(overrides)
    ckpts = Checkpoints(cfg, runs)
    with ckpts, Session(cfg, build_plan(cfg), runs / "out", checkpoints=ckpts) as s:
        for step in (0, 1):
            s.log({STEP_TIME: 0.1, REWARD_DROPPED_FRAC: 0.0}, step)
            s.record_samples(step, torch.arange(step * PER_STEP, (step + 1) * PER_STEP), torch.ones(PER_STEP) > 0)
        s.save_checkpoint(FakeCluster(), 2, {"sampler": {}})
        run_id = s.run_id
    store = f"sqlite:///{runs}/mlflow.db"

    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert verify_run.main([str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"relax-verify-run: MLflow run {run_id} (FINISHED) in {store}"
    assert not (elsewhere / "mlflow.db").exists()
    # --uri still wins (here: this directory's store, which has no such run)
    assert verify_run.main([str(tmp_path / "ckpt"), "--uri", "sqlite:///mlflow.db"]) == 2
    assert f"sqlite:///{elsewhere}/mlflow.db" in capsys.readouterr().err

    cfg = load_config([*overrides, "train.resume=auto"])
    ckpts = Checkpoints(cfg, elsewhere)
    with pytest.raises(RunError) as info:
        with ckpts, Session(cfg, build_plan(cfg), elsewhere / "out", checkpoints=ckpts):
            pass
    assert str(info.value).endswith(f"; the checkpoint's run was recorded in {store}: run with tracking.uri={store}")
