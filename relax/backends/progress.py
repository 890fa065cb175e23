"""How far this process's compute has got: a counter that the backends advance as they work (after each decoded
token, each micro-batch), read by the role's heartbeat (`relax.roles.heartbeat`). A role whose call runs but no
longer advances it is hung. One counter per process: each role is its own process."""

from __future__ import annotations

_count = 0


def tick() -> None:
    """One unit of work done (a token decoded for the batch, a micro-batch's forward or backward)."""
    global _count
    _count += 1


def count() -> int:
    return _count
