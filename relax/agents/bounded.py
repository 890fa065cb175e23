"""A time limit on the user's code an episode waits on between model turns: an environment's `step` (`data.env`) or
an agent loop's `turn` (`data.agent`), `data.env_timeout_s`.

The call runs in a daemon thread of its own and the episode waits for it at most `timeout_s`; past that the episode
ends with `StepTimeout` (its group left out like a failed reward call, `relax.runner.rollout_driver.scoring`) and the
rollout goes on. A thread cannot be stopped from outside, so the late call is abandoned, not killed: it runs on in
its thread until it returns (its result discarded), holding whatever it holds (a socket, a lock of the
environment's). Environments are stateful objects of the rollout process, built per episode, so they cannot move to
a worker process the way tools do (`relax.agents.tools`, killed at `data.tool_timeout_s`). A call stuck in C code
that holds the GIL would stall the thread that waits too; the watchdog (`cluster.heartbeat_timeout_s`) still
catches that one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Optional, TypeVar

T = TypeVar("T")


class StepTimeout(Exception):
    """An environment's step or an agent loop's turn did not return within `data.env_timeout_s`."""


def call_within(fn: Callable[[], T], timeout_s: Optional[float], what: str) -> T:
    """`fn()`, in a thread of its own when `timeout_s` is a number: its result, or its exception raised again here;
    `StepTimeout` naming `what` (e.g. "data.env=my_envs:Search: Search.step") when it has not returned within
    `timeout_s` seconds (the call is left running, see the module docstring). None: called here, no limit."""
    if timeout_s is None:
        return fn()
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the waiting thread, which raises it as the call would have
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="relax-env-step", daemon=True).start()
    if not done.wait(timeout_s):
        raise StepTimeout(f"{what} did not return within data.env_timeout_s={timeout_s:g} s (the call is abandoned "
                          "in its thread, not killed)")
    if "error" in box:
        raise box["error"]
    return box["value"]
