"""A reward for tests/rewards/test_reward_workers_run.py (imported as `pid_rewards:digits_with_pid`, the test puts this
directory on sys.path): the digits reward, each call recorded with the process that made it.

`RELAX_TEST_REWARD_DIR`: where each process appends its calls (`calls-<pid>.jsonl`: pid, response, label, reward).
`RELAX_TEST_REWARD_BARRIER=N`: a process's first call waits until N processes have made theirs (each leaves a
`ready-<pid>` file), so that N reward workers are each seen to take calls, instead of the first one started taking
every call before the others are up; a barrier never met within `BARRIER_TIMEOUT_S` fails that call (a reward error
the test sees), never hangs the run. The process `RELAX_TEST_DRIVER_PID` names (the test's) never waits."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from relax.rewards.digits import digits_reward

BARRIER_TIMEOUT_S = 45.0  # under the run's data.reward_timeout_s (60 s by default)
_passed = False


def _barrier(directory: Path, n: int) -> None:
    global _passed
    if _passed or str(os.getpid()) == os.environ.get("RELAX_TEST_DRIVER_PID"):
        return  # once per process; never in the driver (calls made there are what the test must see, quickly)
    _passed = True  # a barrier not met fails this process's first call only
    (directory / f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while len(list(directory.glob("ready-*"))) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} reward processes did not all take a call within {BARRIER_TIMEOUT_S:g} s")
        time.sleep(0.005)  # a poll of the other processes' files, not a wait for an event to happen by itself


def digits_with_pid(response: str, label: str) -> float:
    directory = Path(os.environ["RELAX_TEST_REWARD_DIR"])
    if os.environ.get("RELAX_TEST_REWARD_BARRIER"):
        _barrier(directory, int(os.environ["RELAX_TEST_REWARD_BARRIER"]))
    value = digits_reward(response, label)
    with open(directory / f"calls-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "response": response, "label": label, "reward": value}) + "\n")
    return value
