"""Worker processes for reward calls with a time limit (`data.reward_timeout_s`): a hung call cannot be stopped
inside a thread, so limited calls run in fresh interpreters that are killed and replaced when a call runs past its
limit (see `relax.rewards.registry` for the contract). The agents' tools (`relax.agents.tools`) run in the same
kind of workers, with their own call function and limit (`data.tool_timeout_s`)."""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import statistics
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe, wait
from multiprocessing.reduction import ForkingPickler as _ForkingPickler
from pathlib import Path
from typing import Optional

from relax.rewards.calls import Outcome, RewardFn, RewardSpecError, call_once

WORKER_START_TIMEOUT_S = 120.0  # a worker that has not loaded the function by then fails the scoring
# A busy worker is killed this long after its call's limit: time for the result of a call that ended in time to
# arrive (a result that arrives is judged by the call's own duration, measured in the worker).
KILL_GRACE_S = 0.1
# Calls that take less than this (their median so far, measured in the workers) are sent up to QUEUE_DEPTH to a worker
# at a time, so that it finds its next call waiting instead of idling for a round trip to the driver, which otherwise
# costs more than such a call itself. Slower calls go one at a time: a call queued behind a slow one would wait while
# another worker idles. Only a call whose message is small is queued behind another (QUEUE_BYTES), so that a send
# never waits on a busy worker's full pipe (a hung call would then hold the driver past every time limit).
FAST_CALL_S = 0.002
QUEUE_DEPTH = 8
QUEUE_BYTES = 4096
_PR_SET_PDEATHSIG = 1  # Linux prctl option: a signal for this process when its parent dies


def _worker_main(fd: int) -> None:
    """A worker process (`python -c`, see `_Worker`): on the connection `fd`, receive the driver's sys.path, the
    pickled function and the pickled caller (`call_once` for rewards), then answer each (index, call) with (index,
    caller(fn, *call), seconds the call took)."""
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    try:  # die with the driver even while stuck in a call
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass
    conn = Connection(fd)
    try:
        path, fn_bytes, caller_bytes = conn.recv()
        sys.path[:] = path + [p for p in sys.path if p not in path]
        fn = pickle.loads(fn_bytes)
        caller = pickle.loads(caller_bytes)
        prepare = getattr(fn, "prepare", None)
        if callable(prepare):  # heavy imports and warm-up, before the first call's time limit starts
            prepare()
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        i, call = msg
        t0 = time.perf_counter()
        outcome = caller(fn, *call)
        conn.send((i, outcome, time.perf_counter() - t0))


class _Worker:
    """One worker process: a fresh interpreter (`python -c`), so nothing of the driver is inherited or re-run."""

    def __init__(self, fn_bytes: bytes, caller_bytes: bytes):
        import subprocess
        import sys

        import relax

        self.conn, child = Pipe()
        root = str(Path(relax.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from relax.rewards.worker_pool import _worker_main; "
             "_worker_main(int(sys.argv[1]))", str(child.fileno())],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self.conn.send((list(sys.path), fn_bytes, caller_bytes))
        self.started = time.monotonic()
        self.starter = threading.current_thread()  # the worker dies with this thread (see `RewardWorkers._fill`)
        self.ready = False
        self.queue: deque[int] = deque()  # indices of the calls sent and not answered, the running one first
        self.head_since = 0.0  # monotonic time by which the running call had started (see `RewardWorkers.run`)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


def pickled(fn: RewardFn, what: str = "reward", limit_name: str = "data.reward_timeout_s") -> bytes:
    """`fn` as it is sent to a worker process; RewardSpecError naming the fix when it cannot be (a lambda, a
    function defined inside another): preflight checks it before a start, the pool uses it."""
    try:
        return pickle.dumps(fn)
    except Exception as exc:
        raise RewardSpecError(f"{what} function {getattr(fn, '__name__', fn)!r} cannot be sent to a worker "
                              f"process ({type(exc).__name__}: {exc}); define it at module level, or call it in "
                              f"the driver without a time limit ({limit_name}=null)") from exc


class RewardWorkers:
    """Worker processes calling one reward function, each call limited in time (see the module docstring).

    `run` deals the calls to idle workers; a call's own duration, measured in its worker, decides whether it was
    in time; a worker still busy `timeout_s` + `KILL_GRACE_S` after its call was sent is killed and replaced. A
    worker that dies during a call fails that call. Workers are fresh interpreters (not forks of the driver, which
    runs Ray and torch threads; not multiprocessing's spawn, which re-runs the driver's main script) and die with
    the driver.
    """

    def __init__(self, fn: RewardFn, processes: Optional[int] = None, *, caller: Callable[..., Outcome] = call_once,
                 limit_name: str = "data.reward_timeout_s", what: str = "reward"):
        """`caller(fn, *call)` runs one call in a worker (a module-level function); `limit_name` and `what` name the
        time limit and the calls in messages."""
        self.fn_bytes = pickled(fn, what, limit_name)
        self.caller_bytes = pickle.dumps(caller)
        self.limit_name, self.what = limit_name, what
        self.processes = processes or default_processes()
        self._workers: list[_Worker] = []
        self._seconds: deque[float] = deque(maxlen=256)  # the durations of the latest calls, measured in the workers

    def _fill(self, n: int) -> None:
        # A worker dies with the thread that started it (PR_SET_PDEATHSIG follows the parent thread): one started by
        # a rollout stream's pump is gone once that stream closes, and is replaced here, before its next call. Its
        # starting thread having ended decides, not whether the kernel has finished killing it yet.
        for w in [w for w in self._workers if w.process.poll() is not None or not w.starter.is_alive()]:
            self._replace(w)
        while len(self._workers) < min(self.processes, n):
            self._workers.append(_Worker(self.fn_bytes, self.caller_bytes))

    def _replace(self, w: _Worker) -> None:
        w.stop()
        self._workers[self._workers.index(w)] = _Worker(self.fn_bytes, self.caller_bytes)

    def run(self, calls: list[tuple], timeout_s: float) -> tuple[list[Outcome], list[bool]]:
        """Outcomes of `calls` (argument tuples of `_call` after `fn`) in order, and which ran past `timeout_s`.

        A worker runs the calls sent to it in order: its running call started when it was sent (an idle worker) or
        when the answer to the call before it arrived, and is killed `timeout_s` + `KILL_GRACE_S` after that; the calls
        queued behind it (see `FAST_CALL_S`) never started and go to the other workers."""
        outcomes: list[Optional[Outcome]] = [None] * len(calls)
        late = [False] * len(calls)
        todo = deque(range(len(calls)))
        self._fill(len(calls))

        def requeue(w: _Worker) -> None:  # the calls waiting behind w's running call, first in line again
            todo.extendleft(reversed(list(w.queue)[1:]))
            w.queue.clear()

        depth = QUEUE_DEPTH if self._fast() else 1  # (the calls of earlier runs decide)
        while todo or any(w.queue for w in self._workers):
            for w in self._workers:
                while w.ready and todo and len(w.queue) < depth:
                    i = todo[0]
                    message = _ForkingPickler.dumps((i, calls[i]))
                    if w.queue and len(message) > QUEUE_BYTES:
                        break
                    todo.popleft()
                    w.conn.send_bytes(message)
                    if not w.queue:
                        w.head_since = time.monotonic()
                    w.queue.append(i)
            waiting = [w for w in self._workers if w.queue or not w.ready]
            deadline = min(w.head_since + timeout_s + KILL_GRACE_S if w.queue else w.started + WORKER_START_TIMEOUT_S
                           for w in waiting)
            for conn in wait([w.conn for w in waiting], timeout=max(0.0, deadline - time.monotonic())):
                w = next(w for w in waiting if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the process died
                    code = w.process.wait()
                    if not w.queue:
                        raise RewardSpecError(f"a {self.what} worker process exited while starting (exit code "
                                              f"{code})") from None
                    outcomes[w.queue[0]] = (None, f"the {self.what} worker process died during the call (exit code "
                                                  f"{code})")
                    requeue(w)
                    self._replace(w)
                    continue
                if msg[0] == "failed":
                    raise RewardSpecError(f"a {self.what} worker process cannot load the {self.what} function:\n"
                                          f"{msg[1]}")
                if msg[0] == "ready":
                    w.ready = True
                    continue
                i, outcome, seconds = msg
                w.queue.popleft()  # (== i: a worker answers its calls in order)
                w.head_since = time.monotonic()  # the next queued call starts now
                self._seconds.append(seconds)
                if seconds > timeout_s:
                    outcome, late[i] = (None, self._timeout_message(timeout_s, seconds)), True
                outcomes[i] = outcome
            now = time.monotonic()
            for w in list(self._workers):
                if w.queue and now > w.head_since + timeout_s + KILL_GRACE_S:
                    i = w.queue[0]
                    outcomes[i], late[i] = (None, self._timeout_message(timeout_s, None)), True
                    requeue(w)
                    self._replace(w)
                elif not w.ready and now > w.started + WORKER_START_TIMEOUT_S:
                    raise RewardSpecError(f"a {self.what} worker process did not load the {self.what} function (and "
                                          f"run its prepare) within {WORKER_START_TIMEOUT_S:g} s")
        return outcomes, late  # type: ignore[return-value]

    def _fast(self) -> bool:
        """Whether the latest calls were fast enough to queue (`FAST_CALL_S`); none yet: no."""
        return bool(self._seconds) and statistics.median(self._seconds) < FAST_CALL_S

    def _timeout_message(self, timeout_s: float, seconds: Optional[float]) -> str:
        took = f"it took {seconds:.3g} s" if seconds is not None else "its worker process was killed"
        return f"{self.what} call timed out: longer than {self.limit_name}={timeout_s:g} s ({took})"

    def close(self) -> None:
        """Stop the worker processes."""
        for w in self._workers:
            w.stop()
        self._workers = []




def default_processes() -> int:
    """Worker processes without `data.reward_workers`: as many as the CPUs this process may use, at most 4."""
    return max(1, min(4, _available_cpus()))


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_POOL: Optional[RewardWorkers] = None
POOL_LOCK = threading.Lock()


def workers_for(fn: RewardFn, processes: Optional[int] = None) -> RewardWorkers:
    """The workers of `fn`, started at its first limited call and reused (one function's workers at a time);
    `processes` (`data.reward_workers`): how many (None: `RewardWorkers`' default)."""
    global _POOL
    try:
        same = _POOL is not None and _POOL.fn_bytes == pickle.dumps(fn) and \
            _POOL.processes == (processes or default_processes())
    except Exception:
        same = False  # RewardWorkers(fn) says why it cannot be pickled
    if not same:
        if _POOL is not None:
            _POOL.close()
            _POOL = None
        _POOL = RewardWorkers(fn, processes)
        atexit.register(_POOL.close)
    return _POOL
