"""Rewards for tests/rewards/test_reward_memory_limit.py (imported as `memory_rewards:<name>`, the test puts this
directory on sys.path, so that the reward worker processes import it too)."""

from __future__ import annotations

import os

GIB = 1 << 30
MIB = 1 << 20


def allocating(response: str, label: str) -> dict:
    """Allocates what the response says ("2GiB", "100MiB", anything else nothing), and reports the process that made
    the call (its pid, logged as an extra): 1.0 when the allocation succeeded."""
    size = {"2GiB": 2 * GIB, "100MiB": 100 * MIB}.get(response, 0)
    # bytes(n) is calloc'd: where the limit does not apply, 2 GiB succeeds without touching (or using) the pages
    block = bytes(size)
    return {"score": float(len(block) == size), "pid": os.getpid()}
