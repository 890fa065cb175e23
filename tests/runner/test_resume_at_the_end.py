"""A run resumed after its end (`train.resume=auto` once the final checkpoint is committed) trains no step: its
closing summary is the one the run ended with (the rewards and the last evaluation come from its MLflow run), and
`tracking.log_model=true` does not log a second model of the step the run already logged. Checked on the `Session`
that resumes it, with a committed final checkpoint of the tiny model (as tests/cli/test_save_hf.py makes it), without
Ray."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from relax.config import load_config
from relax.data.tokenizer import load_tokenizer, stop_token_ids
from relax.metrics import EVAL_STEP_TAG, EVAL_STEP_WEIGHTS
from relax.roles.workers import ModelInfo, PolicyWorker
from relax.runner.checkpoint import Checkpoints
from relax.tracking import RunOptions, Tracker

pytestmark = pytest.mark.xdist_group("resume_at_the_end")

# the original run's metrics: rewards at steps 0, 1; the evaluation after the last step, at step 2 (the weights of
# 2 training steps; two sets, in the order the run evaluates them: digits, then extra)
REWARDS = [0.25, 0.5]
EVAL = {"eval/digits/mean_at_4": 0.375, "eval/digits/pass_at_1": 0.375, "eval/digits/pass_at_4": 0.75,
        "eval/digits/response_len": 3.0, "eval/extra/mean_at_4": 0.125, "eval/extra/pass_at_1": 0.125,
        "eval/extra/pass_at_4": 0.5}


def finished_run(tmp: Path, *extra: str, evaluations: bool = True, resume_with: tuple[str, ...] = (),
                 older: bool = False):
    """(config of the resume, run id): a run of 2 steps whose final checkpoint is committed and names its MLflow run.
    `older`: as a Relax before EVAL_STEP_TAG logged it (its last evaluation at step 1, no tag)."""
    overrides = ["model.dtype=float32", f"train.save_dir={tmp / 'ckpt'}", "tracking.progress=true",
                 f"tracking.uri=sqlite:///{tmp}/mlflow.db", "train.num_rollout=2", *extra]
    cfg = load_config(overrides)
    with Tracker.start(cfg.tracking, RunOptions(announce=False, background=False)) as tracker:
        if not older:
            tracker.set_tags({EVAL_STEP_TAG: EVAL_STEP_WEIGHTS})
        tracker.log_metrics({"rollout/raw_reward": REWARDS[0]}, 0)
        tracker.log_metrics({"rollout/raw_reward": REWARDS[1], **(EVAL if evaluations and older else {})}, 1)
        if evaluations and not older:
            tracker.log_metrics(EVAL, 2)
        run_id = tracker.run_id
    tokenizer = load_tokenizer(cfg.model)
    info = ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     eos_token_ids=stop_token_ids(cfg.model, tokenizer))
    actor = PolicyWorker(cfg, info, threads=1)
    with Checkpoints(cfg) as ckpts:
        staging = ckpts.staging(2)
        actor.save(str(staging / "policy"))
        ckpts.commit(staging, 2, {"sampler": {}, "mlflow_run_id": run_id})
    return load_config([*overrides, "train.resume=auto", *resume_with]), run_id


def resume_at_the_end(cfg, out: Path, eval_sets=("digits", "extra")) -> tuple[str, str]:
    """Resume the run as relax.runner.train does when no step is left: (the session's stderr, the run id)."""
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    err = io.StringIO()
    with contextlib.redirect_stderr(err), Checkpoints(cfg) as ckpts, \
            Session(cfg, build_plan(cfg), out, checkpoints=ckpts) as session:
        session.eval_set_order = list(eval_sets)  # what log_datasets records of the run's eval sets
        session.finish()
    return err.getvalue(), session.run_id


def summary_block(text: str) -> str:
    return text[text.index("Relax run finished"):]


def row(block: str, label: str) -> str | None:
    """The value of a row of the summary block."""
    found = re.search(rf"^  {re.escape(label)}  +(.+)$", block, re.M)
    return found.group(1) if found else None


def test_the_summary_of_a_run_resumed_at_its_end_keeps_its_eval_line(tmp_path, fresh_store):
    fresh_store(tmp_path)
    cfg, run_id = finished_run(tmp_path)
    text, resumed = resume_at_the_end(cfg, tmp_path / "out")
    assert resumed == run_id
    block = summary_block(text)
    assert row(block, "final reward") == "0.375" and row(block, "best reward") == "0.5"
    assert row(block, "steps") == "2"
    # as the run printed it: each set's mean@n then pass@k by k, the sets in evaluation order
    lines = [line.strip() for line in block.splitlines() if line.strip().startswith("eval ")]
    assert lines == ["eval digits (step 2)  mean@4 0.375  pass@1 0.375  pass@4 0.75",
                     "eval extra (step 2)   mean@4 0.125  pass@1 0.125  pass@4 0.5"]
    assert "started by an older Relax" not in text


def test_a_run_made_before_the_eval_step_tag_is_continued_with_a_warning(tmp_path, fresh_store):
    """Its evaluations stay where they were logged (MLflow values cannot move): the summary shows its last one at
    step 1, the run warns that they sit one step early, and the tag says from which step they do not."""
    from mlflow import MlflowClient

    fresh_store(tmp_path)
    cfg, run_id = finished_run(tmp_path, older=True)
    text, _ = resume_at_the_end(cfg, tmp_path / "out")
    assert f"MLflow run {run_id} was started by an older Relax, which logged the evaluation after 0-based step s " \
           "at step s; from step 2 on, this job logs it at s + 1" in text
    assert "eval digits (step 1)  mean@4 0.375" in summary_block(text)
    tags = MlflowClient(cfg.tracking.uri).get_run(run_id).data.tags
    assert tags[EVAL_STEP_TAG] == f"{EVAL_STEP_WEIGHTS} from step 2 (before: one less)"
    # the control: a run that never evaluated has nothing logged the old way, and is tagged as a new one
    fresh_store(tmp_path / "b")
    cfg, run_id = finished_run(tmp_path / "b", evaluations=False, older=True)
    text, _ = resume_at_the_end(cfg, tmp_path / "b" / "out")
    assert "older Relax" not in text
    assert MlflowClient(cfg.tracking.uri).get_run(run_id).data.tags[EVAL_STEP_TAG] == EVAL_STEP_WEIGHTS


def test_control_a_run_that_never_evaluated_has_no_eval_line(tmp_path, fresh_store):
    fresh_store(tmp_path)
    cfg, _ = finished_run(tmp_path, evaluations=False)
    block = summary_block(resume_at_the_end(cfg, tmp_path / "out")[0])
    assert row(block, "final reward") == "0.375" and "eval " not in block


@pytest.mark.slow
def test_a_run_resumed_at_its_end_does_not_log_its_model_twice(tmp_path, fresh_store):
    """The first resume that turns tracking.log_model on logs the final checkpoint's model; resuming again (the same
    step) logs none and keeps the run's relax.model_uri."""
    from mlflow import MlflowClient

    fresh_store(tmp_path)
    cfg, run_id = finished_run(tmp_path, "train.save_hf=true", "tracking.log_model=true")
    client = MlflowClient(cfg.tracking.uri)
    experiment = client.get_run(run_id).info.experiment_id
    text, _ = resume_at_the_end(cfg, tmp_path / "out1")
    uri = client.get_run(run_id).data.tags["relax.model_uri"]
    assert f"as the model {uri}" in text
    assert len(client.search_logged_models(experiment_ids=[experiment])) == 1  # the control: the first one is logged
    text, _ = resume_at_the_end(cfg, tmp_path / "out2")
    assert f"MLflow run {run_id} already holds the model of step 2, {uri}: not logged again" in text
    assert row(summary_block(text), "MLflow model") == uri
    assert len(client.search_logged_models(experiment_ids=[experiment])) == 1
    assert client.get_run(run_id).data.tags["relax.model_uri"] == uri


def test_a_sweep_job_resumed_by_another_sweep_moves_to_its_parent(tmp_path, fresh_store):
    """The Session hands the new sweep's parent (tracking.parent_run_id, set by the launcher) to the reopened run."""
    from mlflow import MlflowClient

    fresh_store(tmp_path)
    cfg, run_id = finished_run(tmp_path, resume_with=("tracking.parent_run_id=P2", "tracking.sweep_id=S2"))
    client = MlflowClient(cfg.tracking.uri)
    client.set_tag(run_id, "mlflow.parentRunId", "P1")  # the run as the first sweep (S1, parent P1) left it
    client.set_tag(run_id, "sweep_id", "S1")
    resume_at_the_end(cfg, tmp_path / "out")
    tags = client.get_run(run_id).data.tags
    assert (tags["mlflow.parentRunId"], tags["sweep_id"]) == ("P2", "S2")
    assert (tags["relax.previous_parent_run_id"], tags["relax.previous_sweep_id"]) == ("P1", "S1")
