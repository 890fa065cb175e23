"""A reward function that injects a process fault into the run that calls it (imported as
`chaos_rewards:digits_with_fault`; runs in the driver, so `data.reward_timeout_s=null`).

`RELAX_CHAOS` = "<process>:<signal>:<call>:<marker file>": at reward call number <call> (counting from 1 over the
run; 16 calls a step in these tests) it sends <signal> (KILL, STOP) to role process <process> ("actor",
"rollout[1]", ...), found by pid on the run's heartbeat board (`relax-heartbeats-*`, see
relax.roles.heartbeat). With `@busy` after the process name ("rollout[1]@busy"), a thread waits until that
process works (it is inside a call: loading weights or generating) and signals it then: a kill in the middle
of a call. The marker
file makes it happen once per test, across restarts of the service graph.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from relax.rewards.registry import get_reward_fn

_digits = get_reward_fn("digits")
_calls: dict[str, int] = {}  # per RELAX_CHAOS setting (one per test)


def _board():
    import ray

    names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors(all_namespaces=False)]
    (name,) = [n for n in names if n.startswith("relax-heartbeats-")]
    return ray.get_actor(name)


def _running_threads(pid: int) -> set[str]:
    """The process's threads that are running or waiting for a core (state R), as opposed to sleeping."""
    running = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] == "R":
                running.add(task.name)
        except (FileNotFoundError, ProcessLookupError):  # the thread ended
            pass
    return running


def _signal_when_busy(board, process: str, sig: int) -> None:
    """`sig` to `process` as soon as it works (loading weights or generating), not between calls: one of its
    threads stays runnable for 25 samples in a row (an idle process's threads sleep; one that computes is running,
    or waiting for a core on a loaded machine, which a measure of CPU time burnt would take for idle)."""
    import ray

    pid = ray.get(board.snapshot.remote())[process].pid
    deadline = time.monotonic() + 120
    streak: dict[str, int] = {}
    while time.monotonic() < deadline:
        running = _running_threads(pid)
        streak = {tid: streak.get(tid, 0) + 1 for tid in running}
        if any(n >= 25 for n in streak.values()):
            os.kill(pid, sig)
            return
        time.sleep(0.001)


def inject() -> None:
    import ray

    spec = os.environ["RELAX_CHAOS"]
    process, sig_name, call, marker = spec.split(":", 3)
    if _calls[spec] != int(call) or Path(marker).exists():
        return
    Path(marker).write_text(f"{process} {sig_name} at call {call}\n")
    sig = getattr(signal, f"SIG{sig_name}")
    board = _board()
    if process.endswith("@busy"):
        threading.Thread(target=_signal_when_busy, args=(board, process.removesuffix("@busy"), sig),
                         daemon=True).start()
        return
    os.kill(ray.get(board.snapshot.remote())[process].pid, sig)


def digits_with_fault(response: str, label: str) -> float:
    spec = os.environ.get("RELAX_CHAOS")
    if spec is not None:
        _calls[spec] = _calls.get(spec, 0) + 1
        inject()
    return _digits(response, label)
