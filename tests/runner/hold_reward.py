"""A user reward function (`hold_reward:reward`): the built-in digits reward, which can hold the run at one call.

With `HOLD_AT_CALL=N` and `HOLD_FILE=path` in the environment, the N-th call (0-based) creates `path` and then
never returns, so a test can kill the run at a known point of the loop (rewards are scored in the driver, in the
rollout stream's scoring thread, between the rollout and the optimizer step). Without them it is exactly `digits`.

With `HOLD_CHECKPOINT=S` as well, the checkpoint of step S (`Recipe._checkpoint`, in the driver's loop) first waits
until the held call has been reached: a barrier, so that this checkpoint always finds the stream's scoring thread
held (it then waits for it for ever), however the generation of the held batch and the training of the step before
that checkpoint happen to interleave. The barrier is installed in the driver when the driver imports this module.
"""

import os
import threading
import time
from pathlib import Path

from relax.rewards.digits import digits_reward

_calls = 0
_held = threading.Event()  # set by the held call, in the scoring thread
BARRIER_LIMIT_S = 300  # past it the checkpoint goes ahead: the test then fails on what was committed, not hangs


def reward(response: str, label: str) -> float:
    global _calls
    if os.environ.get("HOLD_AT_CALL") and _calls == int(os.environ["HOLD_AT_CALL"]):
        Path(os.environ["HOLD_FILE"]).touch()
        _held.set()
        while True:  # until killed
            time.sleep(1)
    _calls += 1
    return digits_reward(response, label)


def _install_barrier(step: int) -> None:
    from relax.runner.train import Recipe

    checkpoint = Recipe._checkpoint

    def _checkpoint(self, s: int) -> None:
        if s + 1 == step:
            _held.wait(BARRIER_LIMIT_S)
        checkpoint(self, s)

    Recipe._checkpoint = _checkpoint


if os.environ.get("HOLD_CHECKPOINT"):
    _install_barrier(int(os.environ["HOLD_CHECKPOINT"]))
