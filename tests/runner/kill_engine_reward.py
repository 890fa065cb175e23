"""The digits reward (imported as `kill_engine_reward:reward`) that kill -9s one rollout engine server (relax-serve)
while scoring the 5th rollout: the engine dies between two rollouts, mid-run, at the same point every time."""

import os
import signal

import psutil

from relax.rewards.digits import digits_reward

CALLS_BEFORE_KILL = 4 * 64  # 4 rollouts of 8 prompts x 8 samples
calls = 0
killed: list[int] = []


def servers() -> list[psutil.Process]:
    """The engine servers a run started (their config lies in the run's relax-sglang-* directory)."""
    return [p for p in psutil.process_iter(["cmdline"]) if "relax.cli.serve" in (p.info.get("cmdline") or [])
            and "relax-sglang-" in " ".join(p.info.get("cmdline") or [])]


def reward(response: str, label: str) -> float:
    global calls
    calls += 1
    if calls == CALLS_BEFORE_KILL + 1:
        victim = servers()[0]
        killed.append(victim.pid)
        os.kill(victim.pid, signal.SIGKILL)
    return digits_reward(response, label)
