"""User-facing `step N` messages count steps as the progress line and the checkpoint names do (docs/operations.md):
the step whose progress line reads `step 3/6` once it is done, and whose checkpoint is `step_000003`, is `step 3` in
the reward-failure stop, the restart messages and the other stops of the loop. Before, those said `step 2` (the
loop's 0-based index), so a stop printed right after `step 3/6 | reward nan` named step 2. Each message is checked
against the progress line's own number for the same step (`relax.tracking.progress.Progress`)."""

from __future__ import annotations

import pytest

from relax.config import load_config
from relax.runner.errors import RoleFailure, RunError
from relax.runner.optimizer_steps import FailedRewardSteps
from relax.runner.restarts import Restarts
from relax.tracking.progress import Progress


def progress_name(index: int, total: int = 6) -> str:
    """How the progress line names the step of 0-based loop index `index`, once it is done: `step 3` of `step 3/6`."""
    line = Progress(total, is_tty=False).format_line(index + 1)
    return line.split("/", 1)[0].replace("  ", " ")


def test_the_reward_failure_stop_names_the_step_the_progress_line_showed():
    failures = FailedRewardSteps(3)
    for _ in range(3):
        failures.count(errors=4, kept=False, first_error="RuntimeError: reward call timed out")
    with pytest.raises(RunError) as info:
        failures.check(2)  # the third step of the loop: index 2
    assert progress_name(2) == "step 3"
    assert str(info.value).startswith("step 3: in 3 step(s) in a row every group was left out"), info.value


def test_the_restart_messages_name_the_step_the_progress_line_would_show(capsys):
    cfg = load_config(["train.save=false"])
    restarts = Restarts(3)
    restarts.step = 0  # the actor hangs during the first step, before any progress line
    restarts.next(cfg, RoleFailure("actor", "hung: no heartbeat for 10 s"))
    err = capsys.readouterr().err
    assert err.startswith(f"{progress_name(0)}: actor hung: no heartbeat for 10 s; restarting the service graph from "
                          "the first step (no checkpoint yet) (restart 1 of train.max_restarts=3)"), err
    assert restarts.events == ["step 1: actor hung: no heartbeat for 10 s; restarted from the first step "
                               "(no checkpoint yet)"]
    restarts.step = 4
    restarts.replace_in_place(RoleFailure("rollout[1]", "died"))
    assert capsys.readouterr().err.startswith("step 5: rollout[1] died; replacing it (restart 2 of ")
    spent = Restarts(0)
    spent.step = 2
    with pytest.raises(RunError, match=r"^step 3: actor died\. The run stops: train\.max_restarts=0 "):
        spent.next(cfg, RoleFailure("actor", "died"))
