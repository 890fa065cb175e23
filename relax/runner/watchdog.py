"""The driver's waits on the roles, bounded by their heartbeats (`relax.roles.heartbeat`).

`Watchdog.get` waits for the answers of role calls the way `ray.get` would, polling every `poll_s`. While a call
is pending, its role must keep sending heartbeats and, for compute calls, keep making progress: a role with no
heartbeat for `cluster.heartbeat_timeout_s`, or whose progress has not changed for that long while the driver waited
on it, is declared hung. A hung or dead role (Ray's `RayActorError`) surfaces as `RoleFailure`, naming the
process, which the training loop answers by restarting the service graph (`train.max_restarts`). Errors raised
inside a role's method (a bad batch, a full disk) stay what they are.

Calls that advance no progress counter (saving and loading checkpoints) are bounded by a deadline of their own
(`train.checkpoint_timeout_s`): a process can keep beating while it is stuck in file I/O (an NFS stall), so the
heartbeat alone would let such a wait last forever. The deadline holds with the watchdog off too.
"""

from __future__ import annotations

import time
from typing import Any

from relax.agents.protocol import UserCodeError
from relax.runner.errors import RoleFailure, RunError

POLL_S = 1.0  # how often a pending wait looks at the heartbeats


class Watchdog:
    """`board`: the `HeartbeatBoard` actor handle (None: no heartbeats, unbounded waits). `names`: actor id (hex)
    -> process name, for the processes the cluster started (kept up to date as roles are replaced)."""

    def __init__(self, board: Any, timeout_s: float | None, poll_s: float = POLL_S):
        self.board, self.timeout_s, self.poll_s = board, timeout_s, poll_s
        self.names: dict[str, str] = {}

    def register(self, actor: Any, process: str) -> None:
        actor_id = getattr(actor, "_actor_id", None)
        if actor_id is not None:
            self.names[actor_id.hex()] = process

    def get(self, calls: list[tuple[Any, str]], *, progress: bool = True,
            deadline: tuple[float, str] | None = None) -> list[Any]:
        """The results of `calls` ((ObjectRef, process name) pairs), in order. `progress=False` for calls that
        advance no progress counter (saving, loading): the heartbeats and `deadline` bound them. `deadline`:
        (seconds, the setting that sets them); a call still pending after it is a RoleFailure."""
        import ray

        pending = [ref for ref, _ in calls]
        t0 = time.monotonic()
        watching = self.board is not None and self.timeout_s is not None
        while pending and (watching or deadline is not None):
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
            if pending:
                waiting = {name for ref, name in calls if ref in set(pending)}
                waited = time.monotonic() - t0
                if watching:
                    self.check(waiting, waited, progress=progress)
                overdue(waiting, waited, deadline)
        out = []
        for ref, name in calls:
            try:
                out.append(ray.get(ref, timeout=None if self.timeout_s is None else self.timeout_s))
            except ray.exceptions.RayActorError as exc:
                raise RoleFailure(self.names.get(getattr(exc, "actor_id", None) or "", name),
                                  f"died: {first_line(exc)}") from None
            except ray.exceptions.GetTimeoutError:  # pragma: no cover - answered refs come back at once
                raise RoleFailure(name, f"did not answer within {self.timeout_s:g} s") from None
            except ray.exceptions.RayTaskError as exc:
                # user code broke its contract in the role (an environment's step, a tool parser's result): the
                # user's mistake, said in one line as relax-train says a RunError, not Ray's traceback of the role
                if isinstance(exc.cause, UserCodeError):
                    raise RunError(f"{name}: {exc.cause}") from None
                raise
        return out

    def get_one(self, ref: Any, process: str, *, progress: bool = True) -> Any:
        return self.get([(ref, process)], progress=progress)[0]

    def check(self, waiting: set[str], waited_s: float, *, progress: bool = True) -> None:
        """RoleFailure if a process of `waiting` (waited on for `waited_s`) is hung."""
        import ray

        T = self.timeout_s
        try:
            beats = ray.get(self.board.snapshot.remote(), timeout=max(10.0, T))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise RoleFailure("heartbeat board", f"stopped answering: {first_line(exc)}") from None
        for name in sorted(waiting):
            beat = beats.get(name)
            if beat is None:  # not heard from yet: its process has not started its heartbeat
                if waited_s > T:
                    raise RoleFailure(name, f"hung: no heartbeat within {T:g} s (cluster.heartbeat_timeout_s)")
                continue
            if beat.beat_age_s > T:
                raise RoleFailure(name, f"hung: no heartbeat for {beat.beat_age_s:.0f} s (process {beat.pid}; "
                                        f"cluster.heartbeat_timeout_s={T:g})")
            stalled = min(beat.progress_age_s, waited_s)
            if progress and stalled > T:
                raise RoleFailure(name, f"hung: no progress for {stalled:.0f} s in its current call (process "
                                        f"{beat.pid}, {beat.progress} units of work and {beat.tokens} tokens "
                                        f"done; cluster.heartbeat_timeout_s={T:g})")


def overdue(waiting: set[str], waited_s: float, deadline: tuple[float, str] | None) -> None:
    """RoleFailure naming the first process of `waiting` once `waited_s` exceeds `deadline` (seconds, setting)."""
    if deadline is not None and waiting and waited_s > deadline[0]:
        limit, setting = deadline
        raise RoleFailure(min(waiting), f"hung: its call did not finish within {limit:g} s ({setting}={limit:g})")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for a one-line cause."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__
