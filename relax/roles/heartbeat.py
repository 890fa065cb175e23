"""Heartbeats sent from inside each role process, and the board that collects them for the driver's watchdog.

Each role process runs a heartbeat thread (`start_heartbeat`) that sends the board, every `interval_s`, its
process id and its progress (`relax.progress`: decoding steps and micro-batches done, tokens
generated). The board, a small Ray actor, notes when each role's heartbeat last arrived and when its progress
last changed, on its own clock; the driver's watchdog (`relax.runner.watchdog`) reads those ages while it waits
on a role. A frozen process stops beating; a call stuck in a deadlock or a never-ending loop keeps beating but
stops progressing: both are seen.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from relax import progress


@dataclass(frozen=True)
class RoleBeat:
    """One role as the board saw it when asked: seconds since its last heartbeat and since its progress changed."""

    beat_age_s: float
    progress_age_s: float
    progress: int  # units of work done (decoding steps, micro-batches)
    pid: int
    tokens: int = 0  # tokens generated


class HeartbeatBoard:
    """The Ray actor the roles' heartbeats go to (named, so that operators and tests can look a role's pid up)."""

    def __init__(self) -> None:
        self._roles: dict[str, list[Any]] = {}  # name -> [last beat, progress, progress changed at, pid, tokens]

    def ping(self) -> str:
        return "ok"

    def beat(self, name: str, pid: int, count: int, tokens: int = 0) -> None:
        now = time.monotonic()
        rec = self._roles.get(name)
        if rec is None or rec[3] != pid or rec[1] != count:  # progress, or a new process (a replaced role)
            self._roles[name] = [now, count, now, pid, tokens]
        else:
            rec[0] = now

    def forget(self, name: str) -> None:
        """A role that was replaced: its old process's record goes (the new one beats under the same name)."""
        self._roles.pop(name, None)

    def snapshot(self) -> dict[str, RoleBeat]:
        now = time.monotonic()
        return {name: RoleBeat(now - beat, now - changed, count, pid, tokens)
                for name, (beat, count, changed, pid, tokens) in self._roles.items()}


@dataclass(frozen=True)
class HeartbeatLink:
    """What a role needs to send heartbeats: the board's actor handle, its own name, how often."""

    board: Any
    name: str
    interval_s: float


def interval_for(timeout_s: float) -> float:
    """Heartbeats often enough that a few lost ones never look like a hang."""
    return min(5.0, max(0.2, timeout_s / 10))


def start_heartbeat(owner: object, link: HeartbeatLink | None) -> None:
    """Send `link.name`'s heartbeats from a daemon thread of this process until `owner` (the role object) is gone
    (a role object lives as long as its process on Ray; in-process tests drop it at the end of a run)."""
    if link is None:
        return
    stop = threading.Event()
    weakref.finalize(owner, stop.set)
    pid = os.getpid()

    def loop() -> None:
        while not stop.is_set():
            try:
                link.board.beat.remote(link.name, pid, progress.count(), progress.tokens())
            except Exception:  # the board is gone: the run is ending (or the driver's watchdog reports it)
                return
            stop.wait(link.interval_s)

    threading.Thread(target=loop, name=f"relax-heartbeat-{link.name}", daemon=True).start()
