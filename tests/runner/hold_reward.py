"""A user reward function (`hold_reward:reward`): the built-in digits reward, which can hold the run at one call.

With `HOLD_AT_CALL=N` and `HOLD_FILE=path` in the environment, the N-th call (0-based) creates `path` and then
never returns, so a test can kill the run at a known point of the loop (rewards are scored in the driver, between
the rollout and the optimizer step). Without them it is exactly `digits`.
"""

import os
import time
from pathlib import Path

from relax.rewards.digits import digits_reward

_calls = 0


def reward(response: str, label: str) -> float:
    global _calls
    if os.environ.get("HOLD_AT_CALL") and _calls == int(os.environ["HOLD_AT_CALL"]):
        Path(os.environ["HOLD_FILE"]).touch()
        while True:  # until killed
            time.sleep(1)
    _calls += 1
    return digits_reward(response, label)
