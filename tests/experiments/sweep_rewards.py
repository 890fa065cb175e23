"""Reward functions for sweep tests (imported as `sweep_rewards:<name>`, from each job's process: the tests set
`data.reward_timeout_s=null` so that the reward runs there).

- `hold`: the digits reward; at call `RELAX_HOLD_CALL` (counted from 1 in this process; the first call after the
  first step's batch) the job writes `<RELAX_HOLD_DIR>/reached-<pid>` and waits, up to 300 s, for
  `<RELAX_HOLD_DIR>/go`: the test interrupts the sweep once every job has reached that point and releases them once
  each has got the interrupt, so every job is interrupted in the same step, whatever the machine's speed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from relax.rewards.registry import get_reward_fn

_digits = get_reward_fn("digits")
_calls = 0


def hold(response: str, label: str) -> float:
    global _calls
    _calls += 1
    if _calls == int(os.environ["RELAX_HOLD_CALL"]):
        where = Path(os.environ["RELAX_HOLD_DIR"])
        (where / f"reached-{os.getpid()}").touch()
        deadline = time.monotonic() + 300
        while not (where / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a file the test writes: the wait itself, not a guess at a duration
    return _digits(response, label)

