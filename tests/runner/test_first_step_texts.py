"""Texts that say where a run starts when no checkpoint is there name the first step as the progress line does
(`step 1/2` once it is done), never "step 0" (the loop's 0-based index): the note of train.resume=auto with nothing
to resume, a restart with no checkpoint yet, and a checkpoint failure that stops a run before any was committed.
Before, they said "starts at step 0 as a new run", "restarted from step 0 (no checkpoint yet)" and "(it starts from
step 0 without a checkpoint)", and the MLflow tag of such a restart read "step 0 (a restart)". MLflow's own step
numbers are 0-based and named as MLflow's ("MLflow step 0"), so those stay."""

from __future__ import annotations

import ast
import errno
import re
from pathlib import Path

import pytest

import relax
from relax.config import load_config
from relax.runner.checkpoint import resume_note
from relax.runner.errors import RoleFailure, RunError
from relax.runner.restarts import Restarts
from relax.tracking.progress import Progress


def progress_name(index: int, total: int = 2) -> str:
    """How the progress line names the step of 0-based loop index `index` once it is done: `step 1` of `step 1/2`."""
    return Progress(total, is_tty=False).format_line(index + 1).split("/", 1)[0].replace("  ", " ")


def test_resume_auto_with_nothing_to_resume_starts_at_the_step_the_progress_line_shows_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    note = resume_note(load_config(["train.resume=auto"]))
    assert progress_name(0) == "step 1"
    assert f"so this run starts at {progress_name(0)} as a new run" in note, note


def test_a_restart_with_no_checkpoint_yet_says_the_first_step(capsys):
    restarts = Restarts(3)
    restarts.step = 0
    restarts.next(load_config(["train.save=false"]), RoleFailure("actor", "died"))
    err = capsys.readouterr().err
    assert f"{progress_name(0)}: actor died; restarting the service graph from the first step (no checkpoint yet)" \
        in err, err
    assert "step 0" not in err and "step 0" not in restarts.events[0]


class WritesThenFails:
    """Cluster.save without Ray: the roles write part of the checkpoint into staging, then the write fails."""

    def save(self, ckpts, step: int, state: dict, rollout=None) -> Path:
        staging = ckpts.staging(step)
        (staging / "policy").mkdir()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_checkpoint_failure_before_any_checkpoint_says_the_run_starts_from_the_first_step(tmp_path):
    from relax.runner.checkpoint import Checkpoints
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    cfg = load_config(["tracking.enabled=false", "tracking.progress=false", f"train.save_dir={tmp_path}/ckpt"])
    ckpts = Checkpoints(cfg, tmp_path)
    session = Session(cfg, build_plan(cfg), tmp_path / "out", checkpoints=ckpts)
    with ckpts, session, pytest.raises(RunError) as info:
        session.save_checkpoint(WritesThenFails(), 1, {"sampler": {}})
    message = str(info.value)
    assert "no checkpoint was committed before it" in message, message
    assert message.endswith("run with train.resume=auto (it starts from the first step without a checkpoint)."), \
        message


def _message_literals(path: Path):
    """The string constants of a module (f-strings' literal parts included), docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def test_no_text_of_the_code_names_a_step_0():
    """A message's literal text saying "step 0" is the loop's 0-based index shown to a user; "MLflow step 0" names
    MLflow's numbering and may stay."""
    root = Path(relax.__file__).parent
    found = [f"{path.relative_to(root.parent)}:{line}: {text[:80]!r}"
             for folder in (root, root.parent / "hydra_plugins") for path in sorted(folder.rglob("*.py"))
             for line, text in _message_literals(path) if re.search(r"(?<!MLflow )\bstep 0\b", text)]
    assert not found, found
