"""The heartbeat board and the driver's watchdog, by their rules (the chaos tests of test_role_failures.py run them
on a real Ray): what counts as hung, and what does not."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from relax import progress
from relax.roles.heartbeat import HeartbeatBoard, HeartbeatLink, RoleBeat, interval_for, start_heartbeat
from relax.runner.errors import RoleFailure
from relax.runner.watchdog import Watchdog


class _Call:
    def __init__(self, fn):
        self.remote = fn


class _Board:
    """A board handle answering `snapshot.remote()` with fixed records (as `ray.get` of it would)."""

    def __init__(self, beats: dict[str, RoleBeat]):
        self.snapshot = _Call(lambda: beats)


@pytest.fixture
def direct_ray(monkeypatch):
    """`ray.get` of a plain value returns it (the board is called directly here)."""
    fake = types.SimpleNamespace(get=lambda value, timeout=None: value,
                                 exceptions=types.SimpleNamespace(RayActorError=type("E1", (Exception,), {}),
                                                                  GetTimeoutError=TimeoutError))
    monkeypatch.setitem(sys.modules, "ray", fake)


def beat(beat_age: float, progress_age: float) -> RoleBeat:
    return RoleBeat(beat_age_s=beat_age, progress_age_s=progress_age, progress=7, pid=123, tokens=40)


@pytest.mark.parametrize("record,waited,progress,hung", [
    (beat(1, 1), 100, True, None),  # beating and progressing
    (beat(1, 50), 100, True, "no progress for 50 s"),  # beating, stuck in its call for longer than the timeout
    (beat(1, 50), 20, True, None),  # stuck since before the call began 20 s ago: idle until then, not hung
    (beat(1, 50), 100, False, None),  # a save or load advances no counter: its deadline bounds it (below)
    (beat(45, 45), 5, False, "no heartbeat for 45 s"),  # frozen (SIGSTOP, a native call holding the GIL)
    (None, 20, True, None),  # not heard from yet, within the timeout
    (None, 40, True, "no heartbeat within 30 s"),
])
def test_what_the_watchdog_declares_hung(direct_ray, record, waited, progress, hung):
    watch = Watchdog(_Board({} if record is None else {"rollout[1]": record}), timeout_s=30)
    if hung is None:
        watch.check({"rollout[1]"}, waited, progress=progress)
        return
    with pytest.raises(RoleFailure, match=hung) as info:
        watch.check({"rollout[1]"}, waited, progress=progress)
    assert info.value.process == "rollout[1]" and info.value.role == "rollout"
    assert "cluster.heartbeat_timeout_s=30" in str(info.value) or "within 30 s" in str(info.value)


class _Ref:
    """A pending call: `ray.wait` of it never answers (the waits below patch `ray.wait`)."""


@pytest.mark.parametrize("board", [True, False], ids=["watchdog", "heartbeats_off"])
def test_a_checkpoint_call_that_keeps_beating_but_never_finishes_fails_at_its_deadline(monkeypatch, board):
    """A save stuck in file I/O keeps its process beating, so no heartbeat rule fires: the deadline does, with the
    watchdog on or without heartbeats at all (a Watchdog without a board: roles called in this process)."""
    clock = [0.0]

    def wait(pending, num_returns, timeout):  # a poll that takes its full timeout and answers nothing
        clock[0] += timeout
        assert clock[0] < 100_000, "the wait has no end"
        return [], pending

    fake = types.SimpleNamespace(wait=wait, get=lambda value, timeout=None: value,
                                 exceptions=types.SimpleNamespace(RayActorError=type("E1", (Exception,), {}),
                                                                  GetTimeoutError=TimeoutError))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    watch = Watchdog(_Board({"actor": beat(1, 10_000)}) if board else None, timeout_s=30 if board else None,
                     poll_s=5)
    with pytest.raises(RoleFailure, match=r"did not finish within 600 s \(train.checkpoint_timeout_s=600\)") as info:
        watch.get([(_Ref(), "actor")], progress=False, deadline=(600.0, "train.checkpoint_timeout_s"))
    assert info.value.process == "actor" and 600 < clock[0] <= 605


def test_the_board_ages_heartbeats_and_progress_on_its_own_clock(monkeypatch):
    """On a clock the test moves (the ages exact; real sleeps made them depend on how busy the machine was)."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    board = HeartbeatBoard()
    board.beat("actor", pid=10, count=5, tokens=0)
    clock[0] += 0.2
    board.beat("actor", pid=10, count=5, tokens=0)  # alive, no progress
    clock[0] += 0.05
    a = board.snapshot()["actor"]
    assert a.beat_age_s == pytest.approx(0.05) and a.progress_age_s == pytest.approx(0.25)
    board.beat("actor", pid=10, count=6, tokens=3)  # progress
    clock[0] += 0.05
    a = board.snapshot()["actor"]
    assert a.progress_age_s == pytest.approx(0.05) and a.progress == 6 and a.tokens == 3
    clock[0] += 0.2
    board.beat("actor", pid=11, count=6, tokens=3)  # a replaced process: starts afresh
    clock[0] += 0.05
    assert board.snapshot()["actor"].progress_age_s == pytest.approx(0.05) and board.snapshot()["actor"].pid == 11
    board.forget("actor")
    assert board.snapshot() == {}


def test_a_role_beats_with_its_progress_until_it_is_gone():
    """Waits for the beats themselves (they are counted as they arrive), never for a time: the thread sends the
    progress, keeps beating, and ends once the role object is gone."""
    board = HeartbeatBoard()
    beats: list[tuple[int, int]] = []  # (progress, tokens) of each beat, in order
    arrived = threading.Condition()

    def beat(name: str, pid: int, count: int, tokens: int = 0) -> None:
        board.beat(name, pid, count, tokens)
        with arrived:
            beats.append((count, tokens))
            arrived.notify_all()

    def wait_for(predicate, what: str) -> None:
        with arrived:
            assert arrived.wait_for(lambda: predicate(beats), timeout=30), f"{what}: {beats}"

    link = HeartbeatLink(types.SimpleNamespace(beat=_Call(beat)), "reference", interval_s=0.05)

    class Role:
        pass

    role = Role()
    before = set(threading.enumerate())
    start_heartbeat(role, link)
    # the new thread of its name (relax.roles.heartbeat): threads left in this worker's process by earlier tests may
    # start at the same moment
    (thread,) = [t for t in set(threading.enumerate()) - before if t.name == "relax-heartbeat-reference"]
    progress.tick(tokens=4)
    now = (progress.count(), progress.tokens())
    wait_for(lambda b: now in b, "a beat with the progress")
    first = board.snapshot()["reference"]
    assert (first.progress, first.tokens) == now
    seen = len(beats)
    wait_for(lambda b: len(b) >= seen + 2, "it keeps beating")  # every interval_s
    del role  # the role object is gone: its thread stops
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert interval_for(300) == 5.0 and interval_for(3) == 0.3 and interval_for(0.5) == 0.2


def test_an_unbounded_heartbeat_timeout_is_rejected_before_anything_starts():
    """cluster.heartbeat_timeout_s=null would leave every wait on a role without an end: rejected, naming a bounded
    way to all but turn the watchdog off."""
    from relax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"cluster.heartbeat_timeout_s=null would let the driver wait .* forever"):
        load_config(["cluster.heartbeat_timeout_s=null"])
    assert load_config(["cluster.heartbeat_timeout_s=86400"]).cluster.heartbeat_timeout_s == 86400
