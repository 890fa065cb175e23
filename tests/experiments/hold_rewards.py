"""The digits reward, holding the run that calls it at a chosen reward call until the test releases it (imported as
`hold_rewards:hold`; it runs in the driver, so `data.reward_timeout_s=null`).

`RELAX_HOLD` = "<call>:<directory>": at reward call number <call> (counting from 1 over the run) it writes
<directory>/held (its process id) and waits until <directory>/release exists (at most 300 s), so that a test can act
on the job (stop it) while a step is in progress and decide when the step may go on.
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
    call, directory = os.environ["RELAX_HOLD"].split(":", 1)
    if _calls == int(call):
        where = Path(directory)
        (where / "held").write_text(str(os.getpid()))
        deadline = time.monotonic() + 300
        while not (where / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return _digits(response, label)
