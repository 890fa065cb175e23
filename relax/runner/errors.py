"""Errors a user can fix (missing weights, unreachable cluster): reported as one message, exit 2. A role process
that died or hung is a `RoleFailure`: the run restarts its service graph (`train.max_restarts`)."""


def step_name(index: int) -> str:
    """A step as user-facing messages name it, `step <index + 1>` for the loop's 0-based `index`: 1-based, as the
    progress line shows the step once it is done (`step 3/6`) and its checkpoint is named (`step_000003`)."""
    return f"step {index + 1}"


class RunError(Exception):
    pass


class RoleFailure(Exception):
    """Role process `process` (e.g. "actor", "rollout[1]") died or hung; `role` is its role ("actor", "rollout")."""

    def __init__(self, process: str, cause: str):
        super().__init__(f"{process} {cause}")
        self.process, self.cause = process, cause

    @property
    def role(self) -> str:
        return self.process.split("[", 1)[0]
