"""The digits reward (imported as `kill_engine_reward:reward`) that kill -9s one rollout engine server (relax-serve)
while scoring the 3rd rollout: the engine dies between two rollouts, mid-run, at the same point every time. The
scoring then waits (in the driver: data.reward_timeout_s=null) until the run's watchdog has started the replacement,
so that it comes during the run whatever the load, not after its last step."""

import os
import signal
import time

import psutil

from relax.rewards.digits import digits_reward

CALLS_BEFORE_KILL = 2 * 8  # 2 rollouts of 2 prompts x 4 samples (the test's batch)
REPLACED_WITHIN_S = 120.0  # health checks (rollout.sglang.health_failures of them) notice the kill first
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
        before = {p.pid for p in servers()}
        victim = servers()[0]
        killed.append(victim.pid)
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + REPLACED_WITHIN_S
        while not {p.pid for p in servers()} - before:  # the replacement's process (the victim's may linger)
            if time.monotonic() > deadline:  # the test then fails on the restart count
                break
            time.sleep(0.05)
    return digits_reward(response, label)
