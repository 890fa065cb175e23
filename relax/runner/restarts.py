"""The run's answer to role processes that die or hang (`RoleFailure`), counted against `train.max_restarts`:
a restart of the whole service graph from the latest checkpoint (`next`), or, for an embedded rollout replica,
its replacement in place (`replace_in_place`, called by
`relax.runner.rollout_driver.engines.ReplicaEngines`). Both kinds share the limit. The counts and events survive
the restarts (one object per run), so the metrics stay cumulative."""

from __future__ import annotations

import dataclasses
import sys
import time

from relax.config.schema import RelaxConfig
from relax.metrics import FAULT_RESTARTS, fault_restarts
from relax.runner import checkpoint
from relax.runner.errors import RoleFailure, RunError, step_name

RESTARTS_TAG = "relax.restarts"  # the MLflow tag of the run's restarts and replacements: step, process, cause
MAX_TAG_CHARS = 4000  # the newest events are kept when they grow longer (MLflow caps tag values)


class Restarts:
    """Restarts and replacements of one run: how many (per role), the events, and the MLflow run they continue."""

    def __init__(self, limit: int):
        self.limit = limit
        self.graph_restarts = 0
        self.by_role: dict[str, int] = {}  # restarts caused by each role, and replicas replaced ("rollout")
        self.events: list[str] = []
        self.run_id: str | None = None  # the MLflow run of the attempts (set once the first one opened it)
        self.step = 0  # the step in progress (where a failure happened), 0-based (messages: `step_name`)
        # the 0-based steps of the job that kept a group (trained), over its attempts (Session.log), less those a
        # restart threw away (`keep_trained_before`): a restarted attempt whose steps all lost every group still
        # belongs to a job that trained when the weights it resumed hold a trained step (Session.finish)
        self.trained: set[int] = set()
        self._tagged = 0  # events already in the MLflow tag
        # when the run began (time.monotonic): the summary's wall time and the progress line's elapsed count from
        # here, across restarts, as the operator's clock does (the hang and the restart included)
        self.started = time.monotonic()

    @property
    def count(self) -> int:
        return sum(self.by_role.values())

    @property
    def can_restart(self) -> bool:
        """Whether another restart is within train.max_restarts (`next` restarts, rather than stops the run)."""
        return self.count < self.limit

    def _take(self, failure: RoleFailure, what: str) -> None:
        if not self.can_restart:
            raise RunError(f"{step_name(self.step)}: {failure}. The run stops: train.max_restarts={self.limit} "
                           f"restart(s) already used ({'; '.join(self.events) or 'none'}).") from None
        self.by_role[failure.role] = self.by_role.get(failure.role, 0) + 1
        self.events.append(f"{step_name(self.step)}: {failure}; {what}")

    def next(self, cfg: RelaxConfig, failure: RoleFailure) -> RelaxConfig:
        """The config of the next attempt: resuming the latest checkpoint. RunError once the limit is reached."""
        latest = checkpoint.latest(checkpoint.resolve_save_dir(cfg)) if cfg.train.save else None
        where = f"checkpoint {latest}" if latest is not None else "the first step (no checkpoint yet)"
        self._take(failure, f"restarted from {where}")
        self.graph_restarts += 1
        print(f"{step_name(self.step)}: {failure}; restarting the service graph from {where} "
              f"(restart {self.count} of train.max_restarts={self.limit})", file=sys.stderr, flush=True)
        return dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, resume=str(latest) if latest is not None else None))

    def keep_trained_before(self, start_step: int) -> None:
        """An attempt starts at `start_step` (0: from scratch; k: from the checkpoint of k steps): the trained steps
        at or after it, whose weights that attempt does not start from, no longer count as the job's."""
        self.trained = {s for s in self.trained if s < start_step}

    def replace_in_place(self, failure: RoleFailure) -> None:
        """Count the replacement of the failed process (re-raises `failure` once the limit is reached)."""
        if self.count >= self.limit:
            raise failure
        self._take(failure, "replaced in place")
        print(f"{step_name(self.step)}: {failure}; replacing it (restart {self.count} of "
              f"train.max_restarts={self.limit})", file=sys.stderr, flush=True)

    def summary(self) -> str | None:
        """The closing summary's `restarts` line: how many and each event; None when there was none."""
        if not self.events:
            return None
        return f"{self.count} of train.max_restarts={self.limit} ({'; '.join(self.events)})"

    def metrics(self) -> dict[str, float]:
        out = {FAULT_RESTARTS: float(self.graph_restarts)}
        out.update({fault_restarts(role): float(n) for role, n in self.by_role.items()})
        return out

    def new_tag(self) -> dict[str, str]:
        """The MLflow tag, when events were added since the last call (else {})."""
        if len(self.events) == self._tagged:
            return {}
        self._tagged = len(self.events)
        return {RESTARTS_TAG: "; ".join(self.events)[-MAX_TAG_CHARS:]}
