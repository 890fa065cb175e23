"""A time limit on the user's code an episode waits on: an environment's `reset` and `step` (`data.env`), an agent
loop's `reset` and `turn` (`data.agent`), and the steps a resumed episode replays, `data.env_timeout_s` each.

A bounded call runs in a daemon thread of its own, started at once (`Bounded`); the episode waits for it at most
`timeout_s` from when the call started; past that the wait ends with `StepTimeout` (the episode fails, its group left
out like a failed reward call, `relax.runner.rollout_driver.scoring`) and the rollout goes on. The engines start the
calls of every episode whose turn ended in the same round before waiting on any (`relax.agents.episode.turn_ends`),
and a batch's resets together (`EpisodeMaker.new_for`, `restore_all`): calls that hang together cost one limit, not
one each. Their results are taken in the episodes' order, so a batch where nothing hangs gets the same results as
calls made one after another (an environment whose episodes share state must guard it: their calls overlap).

A thread cannot be stopped from outside, so the late call is abandoned, not killed: it runs on in its thread until
it returns (its result discarded), holding whatever it holds (a socket, a lock of the environment's). Environments
are stateful objects of the rollout process, built per episode, so they cannot move to a worker process the way
tools do (`relax.agents.tools`, killed at `data.tool_timeout_s`). A call stuck in C code that holds the GIL would
stall the thread that waits too; the watchdog (`cluster.heartbeat_timeout_s`) still catches that one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, Optional, TypeVar

T = TypeVar("T")


class StepTimeout(Exception):
    """An environment's reset or step, or an agent loop's reset or turn, did not return within
    `data.env_timeout_s`."""


class Bounded(Generic[T]):
    """Calls `calls` ((what, fn) pairs: "data.env=my_envs:Search: Search.step" and the call) made one after another,
    each limited to `timeout_s` seconds from its own start; `result()` is `then` of the last one's value (`then`
    runs in the waiting thread). With a number they start now, in a thread of their own; with None they are made in
    `result()`, in the caller's thread, without a limit (as a plain call would be)."""

    def __init__(self, calls: Sequence[tuple[str, Callable[[], Any]]], timeout_s: Optional[float],
                 then: Optional[Callable[[Any], T]] = None):
        if not calls:
            raise ValueError("Bounded: no calls")
        self.calls, self.timeout_s, self.then = list(calls), timeout_s, then
        self.seconds = 0.0  # how long the calls ran (until they returned, or until the wait gave up)
        self._box: dict[str, Any] = {}
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._what, self._started = self.calls[0][0], self._t0  # the call running now, and since when
        if timeout_s is not None:
            threading.Thread(target=self._run, name="relax-env-step", daemon=True).start()

    @classmethod
    def done(cls, value: T) -> Bounded[T]:
        """A result already known (a turn answered without calling the environment)."""
        out: Bounded[T] = cls([("", lambda: value)], None)
        return out

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            value = None
            for what, fn in self.calls:
                with self._lock:
                    self._what, self._started = what, time.perf_counter()
                value = fn()
            self._box["value"] = value
        except BaseException as exc:  # handed to the waiting thread, which raises it as the call would have
            self._box["error"] = exc
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def result(self) -> T:
        """The last call's value, or the exception a call raised, raised again here; `StepTimeout` naming the call
        that has not returned within `timeout_s` of its start (it is left running, see the module docstring)."""
        if self.timeout_s is None:
            if not self._done.is_set():
                self._run()
        else:
            while not self._done.wait(max(0.0, self._started + self.timeout_s - time.perf_counter())):
                with self._lock:
                    what, started = self._what, self._started
                if time.perf_counter() >= started + self.timeout_s:  # (else a later call started meanwhile)
                    self.seconds = time.perf_counter() - self._t0
                    raise StepTimeout(f"{what} did not return within data.env_timeout_s={self.timeout_s:g} s (the "
                                      "call is abandoned in its thread, not killed)")
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"] if self.then is None else self.then(self._box["value"])


def call_within(fn: Callable[[], T], timeout_s: Optional[float], what: str) -> T:
    """`fn()`, in a thread of its own when `timeout_s` is a number: its result, or its exception raised again here;
    `StepTimeout` naming `what` when it has not returned within `timeout_s` seconds (the call is left running, see
    the module docstring). None: called here, no limit."""
    return Bounded([(what, fn)], timeout_s).result()
