"""A run shorter than `data.max_failed_reward_steps` whose every step left every group out (an agent program, an
environment or a reward function failing every episode) runs to its end, as docs/agents.md says; its closing summary
says that nothing was trained and which steps lost every group, instead of a bare "final reward nan", and then the
job fails (`NothingTrained`, the summary's title as its one-line error): relax-train exits 1 with it, a sweep counts
the job FAILED. Checked on the `Session` that logs the steps and prints the summary, without Ray, and on relax-train's
entry point with the runner's `run` replaced; the control is a run with one step that kept a group, whose summary is
the usual one and which returns its result. Before (the lead's decision of Dec 6): the job exited 0."""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

import pytest

from relax.config import load_config
from relax.metrics import RAW_REWARD
from relax.runner.checkpoint import config_yaml
from relax.runner.errors import NothingTrained, RunError

LINE = ("nothing trained: every group of every step was left out (steps 1-2: their reward calls or episodes failed; "
        "the warnings above name each step's first failure)")


def summary_of(tmp: Path, kept: list, *overrides: str) -> str:
    """The summary block a Session prints after logging one step per `kept` (False: every group left out, so the
    step's raw reward is NaN, as rollout_metrics gives it); a job that trained nothing fails after printing it
    (the error is checked by `failure_of`)."""
    text = _finished(tmp, kept, *overrides)[0]
    return text[text.index("Relax run finished"):]


def failure_of(tmp: Path, kept: list, *overrides: str) -> NothingTrained | None:
    return _finished(tmp, kept, *overrides)[1]


def _finished(tmp: Path, kept: list, *overrides: str) -> tuple[str, NothingTrained | None]:
    from relax.runner.plan import build_plan
    from relax.runner.session import RunResult, Session

    cfg = load_config(["tracking.enabled=false", "tracking.progress=true", f"train.num_rollout={len(kept)}",
                       *overrides])
    err, failure = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(err), Session(cfg, build_plan(cfg), tmp / "out") as session:
            for step, k in enumerate(kept):  # MASKED: groups kept, every response masked (mask_truncated)
                session.log({RAW_REWARD: 0.5 if k else math.nan, "rollout/reward_dropped_frac": 0.0 if k else 1.0},
                            step, kept=bool(k), trained=k is not MASKED)
            assert isinstance(session.finish(), RunResult)  # it returns only when a step trained
    except NothingTrained as exc:
        failure = exc
    return err.getvalue(), failure


MASKED = "masked"  # a step that kept groups but whose every kept response algorithm.mask_truncated left out


def row(block: str, label: str) -> str | None:
    found = re.search(rf"^  {re.escape(label)}  +(.+)$", block, re.M)
    return found.group(1) if found else None


def test_a_run_whose_every_group_was_left_out_says_nothing_was_trained(tmp_path):
    block = summary_of(tmp_path, [False, False])
    assert block.splitlines()[0] == "Relax run finished (nothing trained: every group of every step was left out)"
    assert row(block, "left out") == ("every group of steps 1-2: their reward calls or episodes failed (the warnings "
                                      "above name each step's first failure); data.max_failed_reward_steps=3 in a "
                                      "row stop a run")
    assert "nan" not in block and row(block, "final reward") is None, block
    assert row(block, "steps") == "2"
    failure = failure_of(tmp_path / "f", [False, False])
    assert failure is not None and str(failure) == LINE and failure.exit_code == 1
    assert failure.result.series("rollout/reward_dropped_frac") == [1.0, 1.0]  # what the run logged, for callers
    one = summary_of(tmp_path / "b", [False], "data.max_failed_reward_steps=0")
    assert row(one, "left out") == ("every group of step 1: their reward calls or episodes failed (the warnings above "
                                    "name each step's first failure)")


def test_a_run_with_a_kept_group_has_the_usual_summary(tmp_path):
    """The control: one step of two kept a group, so a step trained: its reward is the run's."""
    block = summary_of(tmp_path, [False, True])
    assert block.splitlines()[0] == "Relax run finished"
    assert row(block, "left out") is None
    assert row(block, "final reward") == "0.5" and row(block, "best reward") == "0.5"
    assert failure_of(tmp_path / "f", [False, True]) is None


def test_a_run_whose_every_kept_response_was_truncated_and_masked_says_nothing_was_trained(tmp_path):
    """algorithm.mask_truncated with every kept response ended by length (rollout.max_response_len too short): no
    response enters the loss, so no step trains; the first such step says so once, and the summary and the job's
    error say nothing was trained and why (before: a run that never trained finished with exit 0 and a reward)."""
    text, failure = _finished(tmp_path, [MASKED, MASKED], "algorithm.mask_truncated=true")
    block = text[text.index("Relax run finished"):]
    assert block.splitlines()[0] == "Relax run finished (nothing trained: every response of every step was left out)"
    cut = ("every kept response ended by length, which algorithm.mask_truncated leaves out of the loss (raise "
           "rollout.max_response_len, or set algorithm.mask_truncated=false)")
    assert row(block, "left out") == f"every response of steps 1-2: {cut} (a note above says so at the first such step)"
    assert text.count("the step trained nothing") == 1 and "step 1: every kept response ended by length" in text
    assert failure is not None and failure.exit_code == 1
    assert str(failure) == (f"nothing trained: every response of every step was left out (steps 1-2: {cut}; a note "
                            "above says so at the first such step)")
    # with a step whose groups were all left out beside it: both causes named
    mixed = summary_of(tmp_path / "m", [False, MASKED], "algorithm.mask_truncated=true")
    assert row(mixed, "left out").startswith("every response of steps 1-2: their reward calls or episodes failed, or "
                                             "every kept response ended by length")
    # the control: one step of them trained
    assert failure_of(tmp_path / "c", [MASKED, True], "algorithm.mask_truncated=true") is None


def test_the_progress_line_of_a_step_that_left_every_group_out_says_so_as_the_summary_does(tmp_path):
    """Its reward has no value (NaN, not logged): the line says why instead of `reward nan` (review-vmr #6); the
    next step's line shows its reward as usual."""
    text = _finished(tmp_path, [False, True])[0]
    lines = [line for line in text.splitlines() if re.match(r"step \d+/2 ", line)]
    assert [line.split(" | elapsed")[0] for line in lines] == [
        "step 1/2  50% | reward - (every group left out)", "step 2/2 100% | reward 0.5"], text
    assert "nan" not in text.lower(), text


def test_a_resumed_run_whose_new_steps_left_every_group_out_says_the_earlier_steps_trained(tmp_path):
    """A run resumed at step 3 (steps 1-3 trained, in the checkpoint it starts from) whose steps 4-5 lose every
    group: no step of this job trained, but the run did, so the title is not "nothing trained" (which contradicted
    its own "steps 5" row and the trained weights it exports). The resume is a stand-in `checkpoints` whose
    `resume.step` is 3, as Checkpoints gives a Session. Before: the "nothing trained" title."""
    import types

    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    cfg = load_config(["tracking.enabled=false", "tracking.progress=true", "train.num_rollout=5"])
    resume = types.SimpleNamespace(step=3, path=tmp_path / "ckpt", tracker_state={}, tracking_uri=None, run_id=None,
                                   ledger=None, state={})
    checkpoints = types.SimpleNamespace(resume=resume, uses_dir=True, save_dir=tmp_path / "ckpts", attachments={},
                                        config_yaml=config_yaml(cfg))
    err = io.StringIO()
    with pytest.raises(NothingTrained) as failure, contextlib.redirect_stderr(err), \
            Session(cfg, build_plan(cfg), tmp_path / "out", checkpoints=checkpoints) as session:
        for step in (3, 4):
            session.log({RAW_REWARD: math.nan, "rollout/reward_dropped_frac": 1.0}, step, kept=False)
        session.finish()
    block = err.getvalue()[err.getvalue().index("Relax run finished"):]
    assert block.splitlines()[0] == ("Relax run finished (no step of this job trained: every group of steps 4-5 was "
                                     "left out; steps 1-3 trained before the resume)"), block
    assert row(block, "left out").startswith("every group of steps 4-5: ")
    assert row(block, "steps") == "5" and "nan" not in block
    # this job trained nothing: it fails too, its error the title's words
    assert str(failure.value) == ("no step of this job trained: every group of steps 4-5 was left out; steps 1-3 "
                                  "trained before the resume (their reward calls or episodes failed; the warnings "
                                  "above name each step's first failure)")


def test_a_restarted_attempt_of_a_job_that_trained_does_not_fail(tmp_path, capsys):
    """A restart (`Restarts`, shared by the job's attempts) resumes the job's own checkpoint: the attempt before
    trained a step, so the job did, even though every step of the last attempt lost every group. The control of the
    same attempt without the earlier one: it fails."""
    from relax.runner.plan import build_plan
    from relax.runner.restarts import Restarts
    from relax.runner.session import Session

    cfg = load_config(["tracking.enabled=false", "tracking.progress=true", "train.num_rollout=2"])
    for trained_before, fails in ((1, False), (0, True)):
        restarts = Restarts(1)
        restarts.trained = set(range(trained_before))  # as Session.log counted them in the attempt before
        with contextlib.ExitStack() as stack:
            if fails:
                stack.enter_context(pytest.raises(NothingTrained))
            session = stack.enter_context(Session(cfg, build_plan(cfg), tmp_path / f"out{trained_before}",
                                                  restarts=restarts))
            session.log({RAW_REWARD: math.nan, "rollout/reward_dropped_frac": 1.0}, 0, kept=False)
            session.log({RAW_REWARD: math.nan, "rollout/reward_dropped_frac": 1.0}, 1, kept=False)
            session.finish()
        out = capsys.readouterr()
        title = "no step of this attempt trained: every group of steps 1-2 was left out; 1 step(s) of an earlier"
        assert (title in out.out + out.err) == (not fails), out  # its summary says why it does not fail


def test_relax_train_exits_1_with_the_one_line_error(tmp_path, capfd, monkeypatch):
    """relax-train's entry point (in this process, the runner's `run` replaced by one that fails as a job that
    trained nothing does): exit 1 and the one line, no traceback; a sweep job raises JobError (the launcher's table:
    FAILED, the sweep's exit 1). The control: another RunError still exits 2."""
    from relax_train_inprocess import relax_train

    from relax.cli import train as cli
    from relax.runner import train as runner

    monkeypatch.chdir(tmp_path)
    for error, code in ((NothingTrained(LINE, None), 1), (RunError("the rollout engine stopped"), 2)):
        def run(*args, error=error, **kwargs):
            raise error
        monkeypatch.setattr(runner, "run", run)
        got, _, err = relax_train(["tracking.enabled=false", "train.num_rollout=2"], capfd)
        assert (got, err) == (code, f"relax-train: error: {error}\n"), err
    monkeypatch.setattr(cli, "_in_sweep", lambda: True)
    with pytest.raises(cli.JobError, match="^nothing trained: "):
        cli._job_fail(LINE, NothingTrained.exit_code)


def test_a_restart_keeps_the_trained_steps_its_checkpoint_holds():
    """A restart from step 0 (no checkpoint yet) throws the earlier attempt's training away, one from the checkpoint
    of k steps keeps the steps before k: what `Session.finish` then counts as the job's trained steps."""
    from relax.runner.restarts import Restarts

    restarts = Restarts(2)
    restarts.trained = {0, 1, 3}
    restarts.keep_trained_before(2)
    assert restarts.trained == {0, 1}
    restarts.keep_trained_before(0)
    assert restarts.trained == set()
