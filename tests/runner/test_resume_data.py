"""A resume checks that the prompt files still hold the prompts the run used (`checkpoint.check_run_data`): each
checkpoint's state.json records the run's prompt sets as the MLflow dataset log records them (digest and size of the
training set and of each eval set: docs/experiments.md, "The datasets"); a file regenerated at the same path since
the run, with as many rows or not, is refused before anything starts (before MLflow reopens the run, before Ray),
in one line naming the set, its option, both sizes and digests, and what to do. An older checkpoint without the
record resumes with a note. The checkpoint is committed by the real start's checks (`preflight` with a stack: the
`Checkpoints` a run commits through), so the record is the one a run writes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.runner import checkpoint
from relax.runner.preflight import preflight


def _write(path: Path, prompts: list[str], labels: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p, "label": a}) + "\n" for p, a in zip(prompts, labels, strict=True)))


def _digest(prompts: list[str], labels: list[str]) -> str:
    """The digest as docs/experiments.md defines it (16 hex characters of a SHA-256 of the prompts as the model sees
    them, here untemplated, and their labels, in order), computed here from the file's own values."""
    h = hashlib.sha256()
    for p, a in zip(prompts, labels, strict=True):
        h.update(json.dumps([p, a], ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()[:16]


PROMPTS = [f"What is {i} + {i}?" for i in range(8)]
LABELS = [str(2 * i) for i in range(8)]
EVAL = [f"What is {i} * 3?" for i in range(4)]
EVAL_LABELS = [str(3 * i) for i in range(4)]


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return ["data=jsonl", f"data.path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'test.jsonl'}",
            "data.apply_chat_template=false", "train.eval_interval=1", f"train.save_dir={tmp_path / 'ckpt'}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "tracking.progress=false", *extra]


@pytest.fixture
def run_checkpoint(tmp_path, mlflow_template) -> tuple[Path, str]:
    """(the checkpoint of step 2 of a run on tmp_path/train.jsonl and test.jsonl, committed through the Checkpoints
    a real start's checks enter; the id of its MLflow run, FINISHED)."""
    from mlflow import MlflowClient

    shutil.copyfile(mlflow_template, tmp_path / "mlflow.db")
    _write(tmp_path / "train.jsonl", PROMPTS, LABELS)
    _write(tmp_path / "test.jsonl", EVAL, EVAL_LABELS)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("data"))
    client.set_terminated(run.info.run_id, "FINISHED")
    cfg = load_config(_overrides(tmp_path, "train.num_rollout=2"))
    with contextlib.ExitStack() as stack:
        pre = preflight(cfg, stack=stack)
        assert pre.ok, pre.problems
        staging = pre.checkpoints.staging(2)
        (staging / "policy").mkdir()
        (staging / "policy" / "weights.json").write_text("{}")  # what the resume's checks read: the manifest
        path = pre.checkpoints.commit(staging, 2, {"sampler": {"dataset_size": 8}, "mlflow_run_id": run.info.run_id})
    return path, run.info.run_id


def _resume(tmp_path: Path, path: Path, *extra: str, num_rollout: int = 3) -> dict[str, str]:
    """The problems of the checks a start runs before Ray for a resume of `path` (as a start runs them: the save
    directory locked and the resume point found by the `Checkpoints` it enters), and the same from a dry run's (the
    directory probed); {} when it starts, at the checkpoint's step. `num_rollout` 0 or 2 (the checkpoint's step): an
    evaluation of the checkpoint."""
    cfg = load_config(_overrides(tmp_path, f"train.resume={path}", f"train.num_rollout={num_rollout}", *extra))
    with contextlib.ExitStack() as stack:
        pre = preflight(cfg, stack=stack)
        if pre.ok:
            assert pre.checkpoints.resume is not None and pre.checkpoints.resume.step == 2
    assert preflight(cfg).problems == pre.problems
    return pre.problems


def test_the_checkpoint_records_the_digest_and_size_mlflow_logs(run_checkpoint):
    path, _ = run_checkpoint
    records = {r["context"]: r for r in checkpoint.read_state(path)["run_data"]}
    assert (records["train"]["name"], records["train"]["digest"], records["train"]["num_prompts"]) == \
        ("jsonl", _digest(PROMPTS, LABELS), 8)
    assert (records["eval"]["name"], records["eval"]["digest"], records["eval"]["num_prompts"]) == \
        ("test", _digest(EVAL, EVAL_LABELS), 4)


def test_a_training_file_regenerated_with_as_many_rows_is_refused_before_anything_starts(
        run_checkpoint, tmp_path, capfd, ray_not_started):
    from mlflow import MlflowClient

    path, run_id = run_checkpoint
    assert _resume(tmp_path, path) == {}  # the control: the run's own files resume
    changed = [p.replace("What is", "Translate to French:") for p in PROMPTS]
    _write(tmp_path / "train.jsonl", changed, LABELS)  # the same row count: the sampler's size check passes
    expected = (f"train.resume={path}: data.path={tmp_path / 'train.jsonl'} no longer holds the prompts that "
                f"checkpoint {path} was trained on (the training set 'jsonl': 8 prompts, digest "
                f"{_digest(PROMPTS, LABELS)} in the run, 8 prompts, digest {_digest(changed, LABELS)} now): the file, "
                "or what renders its prompts (the chat template, data.system_prompt, tools), changed since the run; "
                "put the run's file and settings back to continue it, or start a new run (tracking.run_name=... or "
                "train.save_dir=...)")
    assert _resume(tmp_path, path) == {"checkpoints": expected}

    # the start itself (relax-train in this process): exit 2 with that line, before MLflow reopens the run and
    # before Ray, so the finished run stays FINISHED
    code, out, err = relax_train(_overrides(tmp_path, "train.resume=auto", "train.num_rollout=3"), capfd)
    assert code == 2, err[-3000:]
    assert f"relax-train: error: {expected.replace('train.resume=' + str(path), 'train.resume=auto')}" in err
    assert "Traceback" not in out + err
    assert not ray_not_started
    assert MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).info.status == "FINISHED"

    # fewer rows: refused the same way, before the start (it was refused by the sampler once the run was reopened)
    _write(tmp_path / "train.jsonl", PROMPTS[:4], LABELS[:4])
    problem = _resume(tmp_path, path)["checkpoints"]
    assert (f"(the training set 'jsonl': 8 prompts, digest {_digest(PROMPTS, LABELS)} in the run, 4 prompts, digest "
            f"{_digest(PROMPTS[:4], LABELS[:4])} now)") in problem

    _write(tmp_path / "train.jsonl", PROMPTS, LABELS)  # the run's file put back: it resumes again
    assert _resume(tmp_path, path) == {}


def test_a_changed_eval_file_is_refused_unless_its_options_changed(run_checkpoint, tmp_path):
    path, _ = run_checkpoint
    labels = ["0"] * 4  # other labels only
    _write(tmp_path / "test.jsonl", EVAL, labels)
    problem = _resume(tmp_path, path)["checkpoints"]
    assert (f"data.eval_path={tmp_path / 'test.jsonl'} no longer holds the prompts that checkpoint {path} was "
            f"evaluated on (the eval set 'test': 4 prompts, digest {_digest(EVAL, EVAL_LABELS)} in the run, 4 prompts, "
            f"digest {_digest(EVAL, labels)} now)") in problem
    assert problem.endswith(": the file, or what renders its prompts (the chat template, data.system_prompt, tools), "
                            "changed since the run; put the run's file and settings back to continue it, give the new "
                            "file under another path (data.eval_path or a data.eval_sets entry), or start a new run "
                            "(tracking.run_name=... or train.save_dir=...)")
    # a resume may change the eval options (data.num_eval_prompts here): the set is then meant to differ
    assert _resume(tmp_path, path, "data.num_eval_prompts=2") == {}
    # an evaluation of the checkpoint is checked the same way: its numbers at step 2 would mix two sets under one name
    assert "evaluated on (the eval set 'test'" in _resume(tmp_path, path, num_rollout=0)["checkpoints"]


def test_an_evaluation_of_the_checkpoint_does_not_check_the_training_file(run_checkpoint, tmp_path):
    """train.num_rollout=0, or the checkpoint's step: nothing is trained and no training prompt is read, so a training
    file regenerated since (for the next experiment) does not stop the evaluation; a resume that trains is refused."""
    path, _ = run_checkpoint
    _write(tmp_path / "train.jsonl", [p.upper() for p in PROMPTS], LABELS)
    assert _resume(tmp_path, path, num_rollout=0) == {}
    assert _resume(tmp_path, path, num_rollout=2) == {}
    assert "was trained on (the training set 'jsonl'" in _resume(tmp_path, path)["checkpoints"]  # the control


@pytest.mark.parametrize("older", ["without the record", "with another digest version"])
def test_an_older_checkpoint_resumes_with_a_note(run_checkpoint, tmp_path, capsys, older):
    """A checkpoint an older Relax wrote: without the record, or with digests of another RUN_DATA_VERSION (what a
    changed digest or prompt rendering bumps: its digests would differ from any computed now)."""
    path, _ = run_checkpoint
    state = checkpoint.read_state(path)
    if older == "without the record":
        del state[checkpoint.RUN_DATA]  # as an older Relax wrote it (state.json is not in its own manifest)
        del state[checkpoint.RUN_DATA_VERSION_KEY]
    else:
        state[checkpoint.RUN_DATA_VERSION_KEY] = checkpoint.RUN_DATA_VERSION - 1
    (path / checkpoint.STATE).write_text(json.dumps(state))
    _write(tmp_path / "train.jsonl", [p.upper() for p in PROMPTS], LABELS)
    capsys.readouterr()
    assert _resume(tmp_path, path) == {}
    assert (f"relax-train: note: checkpoint {path} was written by an older Relax: it does not say which prompts the "
            f"run used, so data.path={tmp_path / 'train.jsonl'} is not checked against it\n") in capsys.readouterr().err
