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
    """The engine servers a run of this process started (their config lies in the run's relax-sglang-* directory;
    they descend from this process's Ray, never another test worker's)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = p.cmdline()
        except psutil.Error:  # gone meanwhile
            continue
        if "relax.cli.serve" in cmdline and "relax-sglang-" in " ".join(cmdline):
            out.append(p)
    return out


def reward(response: str, label: str) -> float:
    global calls
    calls += 1
    if calls == CALLS_BEFORE_KILL + 1:
        victim = servers()[0]
        killed.append(victim.pid)
        os.kill(victim.pid, signal.SIGKILL)
    return digits_reward(response, label)
