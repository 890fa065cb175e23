"""Reward calls with a time limit: a hung call fails (its worker process is killed and replaced), others score."""

from __future__ import annotations

import os
import time
from collections import deque

import pytest

from relax.rewards import worker_pool
from relax.rewards.registry import RewardSpecError, get_reward_fn, score_responses
from relax.rewards.worker_pool import RewardWorkers


def test_hung_calls_fail_within_the_limit_and_the_others_score():
    fn = get_reward_fn("fault_rewards:hangs")  # hangs when the character codes sum to a multiple of 5
    responses = ["7", "17", "7a", "x7", "3", "2"]
    t0 = time.perf_counter()
    scores = score_responses(fn, responses, ["7"] * 6, timeout_s=0.3)
    took = time.perf_counter() - t0
    assert scores.failed == [True, False, False, True, False, True]
    assert scores.rewards == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert scores.timeouts == scores.errors == 3
    assert "timed out: longer than data.reward_timeout_s=0.3 s" in scores.first_error
    assert took < 10, took  # three hung calls on replaced workers, not an hour each
    again = score_responses(fn, ["17"] * 4, ["7"] * 4, timeout_s=0.3)  # the workers are reused, all healthy
    assert again.failed == [False] * 4 and again.timeouts == 0


class _Recording(deque):
    """A worker's queue of calls that remembers how long it got."""

    longest = 0

    def append(self, x):
        super().append(x)
        self.longest = max(self.longest, len(self))


def _record_queues(pool: RewardWorkers) -> list[_Recording]:
    for w in pool._workers:
        w.queue = _Recording(w.queue)
    return [w.queue for w in pool._workers]


def test_fast_calls_are_queued_and_those_behind_a_hung_call_score_on_other_workers():
    """Calls that took less than FAST_CALL_S are sent several to a worker at a time; a hung call's worker is killed
    at its limit and the calls queued behind it, which never started, run on the other workers."""
    ok, hung = (("17", "7"), {}), (("7", "7"), {})  # `hangs` hangs on "7" (its codes sum to 55); (args, kwargs)
    pool = RewardWorkers(get_reward_fn("fault_rewards:hangs"), processes=2)
    try:
        first, _ = pool.run([ok] * 4, 5.0)  # one at a time: nothing is known of the calls yet
        assert [o[0] for o in first] == [1.0] * 4
        queues = _record_queues(pool)
        outcomes, late = pool.run([ok] * 3 + [hung] + [ok] * 12, 0.5)
        assert max(q.longest for q in queues) > 1  # queued: the calls so far were fast
        assert late == [False] * 3 + [True] + [False] * 12
        assert [o[0] for i, o in enumerate(outcomes) if i != 3] == [1.0] * 15
        assert "timed out: longer than data.reward_timeout_s=0.5 s" in outcomes[3][1]
    finally:
        pool.close()


def test_slow_calls_go_one_at_a_time():
    """The control: calls slower than FAST_CALL_S are never queued behind one another."""
    ok = (("17", "7"), {})
    pool = RewardWorkers(get_reward_fn("fault_rewards:hangs"), processes=2)
    try:
        pool.run([ok] * 2, 5.0)
        pool._seconds.extend([worker_pool.FAST_CALL_S * 2] * 256)  # as if every call had been slow
        queues = _record_queues(pool)
        outcomes, late = pool.run([ok] * 8, 5.0)
        assert late == [False] * 8 and [o[0] for o in outcomes] == [1.0] * 8
        assert max(q.longest for q in queues) == 1
    finally:
        pool.close()


def test_cancel_stops_a_hung_call_at_once_and_the_pool_scores_again(monkeypatch):
    """The `cancel` event of a run, set from another thread (the rollout stream closing: a run stopped at once) and
    then `wake`, wakes `run` from its wait on a call that would hang until its limit (600 s here): the busy worker
    is killed, `run` raises CallsCancelled, and the next run scores on a new worker. The cancel lands while `run`
    waits for the hung call's answer (a hook on the pool's wait, once the call was sent); one set before `run` starts
    stops it too (none is lost between the two); a run leaves no descriptor open."""
    import threading

    ok, hung = (("17", "7"), {}), (("7", "7"), {})  # `hangs` hangs on "7"
    pool = RewardWorkers(get_reward_fn("fault_rewards:hangs"), processes=1)
    waiting, real_wait = threading.Event(), worker_pool.wait

    def spy(objects, timeout=None):
        if any(w.queue for w in pool._workers):  # the hung call was sent: run waits for its answer
            waiting.set()
        return real_wait(objects, timeout)

    raised: list[BaseException] = []
    cancel = threading.Event()

    def score() -> None:
        try:
            pool.run([hung], 600.0, cancel)
        except BaseException as exc:  # noqa: BLE001 - what run raised, for the assertions
            raised.append(exc)

    try:
        pool.run([ok], 60.0)  # the worker started (its descriptors are the pool's from now on)
        fds = len(os.listdir("/proc/self/fd"))
        monkeypatch.setattr(worker_pool, "wait", spy)
        thread = threading.Thread(target=score)
        thread.start()
        assert waiting.wait(60)
        busy = [w.process for w in pool._workers]
        t0 = time.perf_counter()
        cancel.set()
        pool.wake()
        thread.join(30)
        assert not thread.is_alive() and time.perf_counter() - t0 < 10
        assert len(raised) == 1 and isinstance(raised[0], worker_pool.CallsCancelled), raised
        assert [p.poll() is not None for p in busy] == [True]  # the hung call's worker is gone
        with pytest.raises(worker_pool.CallsCancelled):  # set before the run: it sends nothing
            pool.run([hung], 600.0, cancel)
        pool.wake()  # no run in progress: nothing happens
        outcomes, late = pool.run([ok] * 2, 60.0, threading.Event())  # a new worker; a new event
        assert [o[0] for o in outcomes] == [1.0, 1.0] and late == [False, False]
        assert len(os.listdir("/proc/self/fd")) == fds  # each run's wake pipe is closed with it
    finally:
        pool.close()


def test_a_raising_call_keeps_its_traceback_and_is_no_timeout():
    scores = score_responses(get_reward_fn("fault_rewards:raises"), ["ab", "abc"], ["a", "a"], timeout_s=5)
    assert scores.failed == [False, True] and scores.timeouts == 0
    assert "Traceback" in scores.first_error and "odd-length" in scores.first_error


def test_an_unpicklable_function_is_refused_with_the_way_out():
    with pytest.raises(RewardSpecError, match=r"data\.reward_timeout_s=null"):
        RewardWorkers(lambda r, label: 1.0)
    assert score_responses(lambda r, label: 1.0, ["a"], ["b"]).rewards == [1.0]  # no limit: called in the driver


def test_workers_started_by_a_thread_that_ended_are_replaced_before_the_next_call():
    """The rollout stream scores in its pump thread; the workers it starts die with that thread (PR_SET_PDEATHSIG
    follows the parent thread). The next call, from any thread, gets new workers: no call fails for it."""
    import threading

    from relax.rewards import worker_pool

    fn = get_reward_fn("fault_rewards:raises")
    if worker_pool._POOL is not None:
        worker_pool._POOL.close()  # workers of earlier tests were started by this thread: start anew in the other
    first: list = []
    pump = threading.Thread(target=lambda: first.append(score_responses(fn, ["ab"] * 2, ["a"] * 2, timeout_s=5)))
    pump.start()
    pump.join()
    assert first[0].failed == [False, False]
    started_by_pump = list(worker_pool._POOL._workers)
    # at once, while the kernel may still be delivering the parent-death signal: a worker not yet reaped counts too
    again = score_responses(fn, ["ab", "cd", "ef"], ["a", "c", "x"], timeout_s=5)
    assert again.failed == [False] * 3 and again.rewards == [1.0, 1.0, 0.0]
    assert not set(worker_pool._POOL._workers) & set(started_by_pump)
    assert all(w.process.wait(10) is not None for w in started_by_pump)  # they did die with the pump thread


def test_prepare_runs_once_per_worker_before_calls_and_outside_their_limit():
    fn = get_reward_fn("fault_rewards:slow_prepare")  # prepare sleeps 1 s; each call may take 0.5 s
    scores = score_responses(fn, ["a", "b", "c"], ["a"] * 3, timeout_s=0.5)
    assert scores.failed == [False] * 3 and scores.rewards == [1.0] * 3 and scores.timeouts == 0


def test_a_failing_prepare_is_reported_with_its_traceback():
    with pytest.raises(RewardSpecError, match="cannot load the reward function(.|\n)*model file is missing"):
        score_responses(get_reward_fn("fault_rewards:broken_prepare"), ["a"], ["a"], timeout_s=5)


def test_the_math_rewards_import_math_verify_in_prepare():
    import subprocess
    import sys

    from relax.rewards.math_reward import arithmetic_reward, math_reward, prepare_math_verify

    assert arithmetic_reward.prepare is math_reward.prepare is prepare_math_verify
    code = ("import sys; from relax.rewards.math_reward import prepare_math_verify as p; "
            "assert 'math_verify' not in sys.modules; p(); assert 'math_verify' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
