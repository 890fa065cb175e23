"""Errors a user can fix (missing weights, unreachable cluster): reported as one message, exit 2. A role process
that died or hung is a `RoleFailure`: the run restarts its service graph (`train.max_restarts`)."""


from relax.tracking.progress import step_name  # noqa: F401 - one helper for user-facing step names (its home)


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
