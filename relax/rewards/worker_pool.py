"""Worker processes for reward calls with a time limit (`data.reward_timeout_s`): a hung call cannot be stopped
inside a thread, so limited calls run in fresh interpreters that are killed and replaced when a call runs past its
limit (see `relax.rewards.registry` for the contract). The agents' tools (`relax.agents.tools`) run in the same
kind of workers, with their own call function and limit (`data.tool_timeout_s`).

Memory (`data.reward_memory_mb`): a reward worker may limit itself, before it loads the function, with
`RLIMIT_DATA`, the process's writable private memory (the heap and anonymous mappings: what a runaway allocation
grows, since Linux 4.7). Not `RLIMIT_AS`: that counts address space only reserved, never written (glibc's 64 MB
malloc arena per thread, torch's and CUDA's reservations, shared libraries' code), several times what a process
uses once torch is imported, so a limit that stops a runaway call would also fail the worker's own imports. An
allocation past the limit raises MemoryError in the call: that call fails, naming the limit, and its worker is
replaced (its state after a failed allocation is not trusted)."""

from __future__ import annotations

import atexit
import os
import pickle
import platform
import re
import signal
import statistics
import sys
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


MEMORY_LIMIT = "data.reward_memory_mb"  # the option that sets a reward worker's memory limit (`_limit_memory`)


class CallsCancelled(Exception):
    """`RewardWorkers.run` stopped before its calls ended: `cancel` was called (the run that asked for them stops at
    once: a second Ctrl-C, `relax.runner.rollout_driver.stream.RolloutStream` closing)."""


def memory_limit_problem() -> Optional[str]:
    """Why this system cannot enforce a reward worker's memory limit (`RLIMIT_DATA` covering anonymous mappings: Linux
    4.7 or later), or None where it can."""
    if not sys.platform.startswith("linux"):
        return f"{MEMORY_LIMIT} needs Linux (RLIMIT_DATA), and this is {platform.system() or sys.platform}"
    numbers = re.match(r"(\d+)\.(\d+)", platform.release())
    if numbers is not None and (int(numbers[1]), int(numbers[2])) < (4, 7):
        return (f"{MEMORY_LIMIT} needs Linux 4.7 or later, whose RLIMIT_DATA counts anonymous mappings (where large "
                f"allocations go); this kernel is {platform.release()}")
    return None


def _limit_memory(memory_mb: int) -> None:
    """Limit this process's writable private memory to `memory_mb` (`RLIMIT_DATA`, soft and hard: the function
    cannot lift it); checked: a mapping past the limit must be refused, else RuntimeError (never a limit that is
    accepted and not applied)."""
    import mmap
    import resource

    size = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_DATA, (size, size))
    try:
        # private, as malloc's are (a shared mapping is not counted); never written: the refusal is the test
        probe = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return
    probe.close()
    raise RuntimeError(f"{MEMORY_LIMIT}={memory_mb}: this kernel ({platform.release()}) does not apply RLIMIT_DATA to "
                       "anonymous mappings, so the limit would not hold")


def is_memory_error(error: Optional[str]) -> bool:
    """Whether a call's failure (its traceback) is a MemoryError."""
    lines = (error or "").strip().splitlines()
    return bool(lines) and re.match(r"MemoryError\b", lines[-1]) is not None


def _worker_main(fd: int) -> None:
    """A worker process (`python -c`, see `_Worker`): on the connection `fd`, receive the driver's sys.path, the
    pickled function, the pickled caller (`call_once` for rewards) and the memory limit in MB (None: none), then
    answer each (index, call) with (index, caller(fn, *call), seconds the call took, whether it ran out of memory
    under that limit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    try:  # die with the driver even while stuck in a call
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass
    conn = Connection(fd)
    try:
        path, fn_bytes, caller_bytes, memory_mb = conn.recv()
        if memory_mb is not None:  # before the function's module and its imports load: they count
            _limit_memory(memory_mb)
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
        try:
            outcome = caller(fn, *call)
        except MemoryError:  # (raised in the caller's own handling of one, formatting its traceback)
            outcome = (None, traceback.format_exc())
        exhausted = memory_mb is not None and outcome[0] is None and is_memory_error(outcome[1])
        conn.send((i, outcome, time.perf_counter() - t0, exhausted))


class _Worker:
    """One worker process: a fresh interpreter (`python -c`), so nothing of the driver is inherited or re-run."""

    def __init__(self, fn_bytes: bytes, caller_bytes: bytes, memory_mb: Optional[int] = None):
        import subprocess

        import relax

        self.conn, child = Pipe()
        root = str(Path(relax.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from relax.rewards.worker_pool import _worker_main; "
             "_worker_main(int(sys.argv[1]))", str(child.fileno())],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self.conn.send((list(sys.path), fn_bytes, caller_bytes, memory_mb))
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
    the driver. With `memory_mb` each worker limits its own memory (see the module docstring): a call that runs out
    fails naming `MEMORY_LIMIT`, and its worker is replaced.
    """

    def __init__(self, fn: RewardFn, processes: Optional[int] = None, *, caller: Callable[..., Outcome] = call_once,
                 limit_name: str = "data.reward_timeout_s", what: str = "reward", memory_mb: Optional[int] = None):
        """`caller(fn, *call)` runs one call in a worker (a module-level function); `limit_name` and `what` name the
        time limit and the calls in messages; `memory_mb` (`data.reward_memory_mb`): each worker's memory limit
        (None: none)."""
        self.fn_bytes = pickled(fn, what, limit_name)
        self.caller_bytes = pickle.dumps(caller)
        self.limit_name, self.what, self.memory_mb = limit_name, what, memory_mb
        self.processes = processes or default_processes()
        self._workers: list[_Worker] = []
        self._seconds: deque[float] = deque(maxlen=256)  # the durations of the latest calls, measured in the workers
        # the write end of the pipe whose byte wakes the `run` in progress from its wait on the workers (`wake`), so
        # that it reads its `cancel` event at once; None between runs
        self._state = threading.Lock()
        self._wake: Optional[Connection] = None

    def _fill(self, n: int) -> None:
        # A worker dies with the thread that started it (PR_SET_PDEATHSIG follows the parent thread): one started by
        # a rollout stream's pump is gone once that stream closes, and is replaced here, before its next call. Its
        # starting thread having ended decides, not whether the kernel has finished killing it yet.
        for w in [w for w in self._workers if w.process.poll() is not None or not w.starter.is_alive()]:
            self._replace(w)
        while len(self._workers) < min(self.processes, n):
            self._workers.append(_Worker(self.fn_bytes, self.caller_bytes, self.memory_mb))

    def _replace(self, w: _Worker) -> None:
        w.stop()
        self._workers[self._workers.index(w)] = _Worker(self.fn_bytes, self.caller_bytes, self.memory_mb)

    def run(self, calls: list[tuple], timeout_s: float,
            cancel: Optional[threading.Event] = None) -> tuple[list[Outcome], list[bool]]:
        """Outcomes of `calls` (argument tuples of `_call` after `fn`) in order, and which ran past `timeout_s`.

        A worker runs the calls sent to it in order: its running call started when it was sent (an idle worker) or
        when the answer to the call before it arrived, and is killed `timeout_s` + `KILL_GRACE_S` after that; the calls
        queued behind it (see `FAST_CALL_S`) never started and go to the other workers.

        `cancel`, set by another thread (which then calls `wake`), stops the run (set before it started too): its busy
        workers are killed (replaced at the next run) and it raises CallsCancelled; a call that hangs would otherwise
        hold the caller up to its time limit."""
        if cancel is None:
            return self._run(calls, timeout_s, None, None)
        wake_r, wake_w = Pipe(duplex=False)  # this run's own: nothing is left open after it
        with self._state:
            self._wake = wake_w
        try:
            return self._run(calls, timeout_s, cancel, wake_r)
        finally:
            with self._state:
                self._wake = None
                wake_w.close()
            wake_r.close()

    def wake(self) -> None:
        """From another thread: the `run` in progress, if any, reads its `cancel` event now rather than at its next
        answer."""
        with self._state:
            if self._wake is not None:
                try:
                    self._wake.send_bytes(b"x")
                except OSError:  # its pipe is full: a byte is waiting already
                    pass

    def _stop_if_cancelled(self, cancel: Optional[threading.Event]) -> None:
        if cancel is not None and cancel.is_set():
            for w in [w for w in self._workers if w.queue or not w.ready]:  # their calls (or start) are abandoned
                w.stop()
                self._workers.remove(w)
            raise CallsCancelled(f"the {self.what} calls were cancelled: the run stops")

    def _run(self, calls: list[tuple], timeout_s: float, cancel: Optional[threading.Event],
             wake: Optional[Connection]) -> tuple[list[Outcome], list[bool]]:
        outcomes: list[Optional[Outcome]] = [None] * len(calls)
        late = [False] * len(calls)
        todo = deque(range(len(calls)))
        self._fill(len(calls))

        def requeue(w: _Worker) -> None:  # the calls waiting behind w's running call, first in line again
            todo.extendleft(reversed(list(w.queue)[1:]))
            w.queue.clear()

        depth = QUEUE_DEPTH if self._fast() else 1  # (the calls of earlier runs decide)
        while todo or any(w.queue for w in self._workers):
            self._stop_if_cancelled(cancel)
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
            woken = [wake] if wake is not None else []
            for conn in wait([*(w.conn for w in waiting), *woken], timeout=max(0.0, deadline - time.monotonic())):
                if conn is wake:
                    self._stop_if_cancelled(cancel)
                    continue
                w = next(w for w in waiting if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the process died
                    code = w.process.wait()
                    if not w.queue:
                        raise RewardSpecError(f"a {self.what} worker process exited while starting (exit code "
                                              f"{code}){self._memory_note()}") from None
                    outcomes[w.queue[0]] = (None, f"the {self.what} worker process died during the call (exit code "
                                                  f"{code}){self._memory_note()}")
                    requeue(w)
                    self._replace(w)
                    continue
                if msg[0] == "failed":
                    raise RewardSpecError(f"a {self.what} worker process cannot load the {self.what} function"
                                          f"{self._memory_note()}:\n{msg[1]}")
                if msg[0] == "ready":
                    w.ready = True
                    continue
                i, outcome, seconds, exhausted = msg
                w.queue.popleft()  # (== i: a worker answers its calls in order)
                w.head_since = time.monotonic()  # the next queued call starts now
                self._seconds.append(seconds)
                if seconds > timeout_s:
                    outcome, late[i] = (None, self._timeout_message(timeout_s, seconds)), True
                elif exhausted:  # the error's last line (the run's warning) names the limit
                    outcome = (None, f"{outcome[1].rstrip()}\n{self.what} call ran out of memory: past {MEMORY_LIMIT}="
                                     f"{self.memory_mb} MB (its worker process's writable memory, RLIMIT_DATA); the "
                                     "worker process is replaced")
                outcomes[i] = outcome
                if exhausted:
                    requeue(w)
                    self._replace(w)
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

    def _memory_note(self) -> str:
        """A hint for a worker that failed or died: with a memory limit, running out of it may be why."""
        if self.memory_mb is None:
            return ""
        return f" (it may have run out of memory: {MEMORY_LIMIT}={self.memory_mb} MB limits each worker process)"

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


def wake_calls() -> None:
    """From another thread, after setting the `cancel` event a reward pool's `run` was given: that run reads it now
    (and raises CallsCancelled), rather than at its next answer."""
    pool = _POOL
    if pool is not None:
        pool.wake()


def workers_for(fn: RewardFn, processes: Optional[int] = None, memory_mb: Optional[int] = None) -> RewardWorkers:
    """The workers of `fn`, started at its first limited call and reused (one function's workers at a time);
    `processes` (`data.reward_workers`): how many (None: `RewardWorkers`' default); `memory_mb`
    (`data.reward_memory_mb`): each one's memory limit (None: none)."""
    global _POOL
    try:
        same = _POOL is not None and _POOL.fn_bytes == pickle.dumps(fn) and \
            _POOL.processes == (processes or default_processes()) and _POOL.memory_mb == memory_mb
    except Exception:
        same = False  # RewardWorkers(fn) says why it cannot be pickled
    if not same:
        if _POOL is not None:
            _POOL.close()
            atexit.unregister(_POOL.close)  # (held by atexit, a replaced pool would stay alive until exit)
            _POOL = None
        _POOL = RewardWorkers(fn, processes, memory_mb=memory_mb)
        atexit.register(_POOL.close)
    return _POOL
