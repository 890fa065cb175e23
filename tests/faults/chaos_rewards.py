"""A reward function that injects a process fault into the run that calls it (imported as
`chaos_rewards:digits_with_fault`; runs in the driver, so `data.reward_timeout_s=null`).

`RELAX_CHAOS` = "<process>:<signal>:<call>:<marker file>": at reward call number <call> (counting from 1 over the
run; 16 calls a step in these tests) it sends <signal> (KILL, STOP) to role process <process> ("actor",
"rollout[1]", ...), found by pid on the run's heartbeat board (`relax-heartbeats-*`, see
relax.roles.heartbeat). The marker file makes it happen once per test, across restarts of the service graph.
(A kill inside a call is made at the driver's dispatch instead: test_role_failures.kill_a_replica_holding_a_call.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from relax.rewards.registry import get_reward_fn

_digits = get_reward_fn("digits")
_calls: dict[str, int] = {}  # per RELAX_CHAOS setting (one per test)


def _board():
    import ray

    names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors(all_namespaces=False)]
    (name,) = [n for n in names if n.startswith("relax-heartbeats-")]
    return ray.get_actor(name)


def board_pid(process: str) -> int:
    """The pid of role process `process` ("actor", "rollout[1]", ...) on the run's heartbeat board."""
    import ray

    return ray.get(_board().snapshot.remote())[process].pid


def inject() -> None:

    spec = os.environ["RELAX_CHAOS"]
    process, sig_name, call, marker = spec.split(":", 3)
    if _calls[spec] != int(call) or Path(marker).exists():
        return
    Path(marker).write_text(f"{process} {sig_name} at call {call}\n")
    sig = getattr(signal, f"SIG{sig_name}")
    os.kill(board_pid(process), sig)


def digits_with_fault(response: str, label: str) -> float:
    spec = os.environ.get("RELAX_CHAOS")
    if spec is not None:
        _calls[spec] = _calls.get(spec, 0) + 1
        inject()
    return _digits(response, label)
