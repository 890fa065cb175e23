"""The digits reward, interrupting the run that calls it at a chosen reward call (imported as
`interrupt_rewards:<name>`; it runs in the driver, so `data.reward_timeout_s=null`). Calls are counted from 1 over
the run, per setting (16 calls a step in these tests: rollout_batch_size 4 x n_samples_per_prompt 4); a setting may
end with ":<anything>" (the test's tmp_path) so that two tests of one process count apart.

- `signals`: `RELAX_SIGNAL` = "<INT|TERM>:<call>[,<call>...]": sends that signal to this process (the driver) at each
  of those calls, as Ctrl-C or a scheduler's preemption would.
"""

from __future__ import annotations

import os
import signal

from relax.rewards.registry import get_reward_fn

_digits = get_reward_fn("digits")
_calls: dict[str, int] = {}  # per setting (one per test)


def _count(spec: str) -> int:
    _calls[spec] = _calls.get(spec, 0) + 1
    return _calls[spec]


def signals(response: str, label: str) -> float:
    spec = os.environ.get("RELAX_SIGNAL")
    if spec is not None:
        name, calls, *_ = spec.split(":")
        if _count(spec) in {int(c) for c in calls.split(",")}:
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
    return _digits(response, label)
