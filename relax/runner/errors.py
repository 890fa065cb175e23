"""Errors a user can fix (missing weights, unreachable cluster): reported as one message, exit 2 (`exit_code`). A
run that went to its end without training (`NothingTrained`) exits 1. A role process that died or hung is a
`RoleFailure`: the run restarts its service graph (`train.max_restarts`)."""


from relax.tracking.progress import step_name  # noqa: F401 - one helper for user-facing step names (its home)


class RunError(Exception):
    exit_code = 2  # relax-train's exit status for it (a bad input, as argparse's usage errors)


class NothingTrained(RunError):
    """A job that ran every step to its end, its summary printed and its records written, in which no step trained:
    every group of every step of this job was left out (its reward calls or episodes failed) in fewer steps than
    data.max_failed_reward_steps, which would have stopped it. It fails (exit 1, the MLflow run FAILED, a sweep's job
    FAILED) so that scripts and sweeps see it; the message is the summary's title, `result` what the run logged."""

    exit_code = 1

    def __init__(self, message: str, result: object):
        super().__init__(message)
        self.result = result  # the RunResult the run would have returned (its history: the steps' metrics)


class RoleFailure(Exception):
    """Role process `process` (e.g. "actor", "rollout[1]") died or hung; `role` is its role ("actor", "rollout")."""

    def __init__(self, process: str, cause: str):
        super().__init__(f"{process} {cause}")
        self.process, self.cause = process, cause

    @property
    def role(self) -> str:
        return self.process.split("[", 1)[0]
