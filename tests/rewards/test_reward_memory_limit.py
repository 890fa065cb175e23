"""`data.reward_memory_mb`: each reward worker process limits its own writable memory (RLIMIT_DATA) before it loads
the function. A call that allocates 2 GiB under a 256 MB limit fails with a message naming data.reward_memory_mb (the
warning's line too), its worker is replaced, and the next call, in the new worker, works; a 100 MiB allocation under
the same limit works (the limit is not one that fails everything). Such a failure is a failed reward call like any
other: counted by data.max_failed_reward_steps, naming the limit. The option is refused below the sandbox's memory
floor and where no call runs in a worker (data.reward_timeout_s=null: the driver; a service), and score_responses
refuses a limit without workers; a system that cannot enforce it is named (preflight refuses it before start)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from relax.config import ConfigError, load_config
from relax.rewards.registry import get_reward_fn, score_responses
from relax.runner.errors import RunError
from relax.runner.optimizer_steps import FailedRewardSteps
from relax.sandbox_limits import MEMORY_FLOOR_MB

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _memory_rewards(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # memory_rewards:<name>, in this process and in the reward workers


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides))
    return str(info.value)


def test_a_call_past_the_limit_fails_naming_it_and_the_next_call_works(caplog):
    fn = get_reward_fn("memory_rewards:allocating")
    with caplog.at_level(logging.WARNING, logger="relax.rewards.registry"):
        scores = score_responses(fn, ["small", "2GiB", "small", "100MiB"], [""] * 4, timeout_s=60, workers=1,
                                 memory_mb=256)
    assert scores.failed == [False, True, False, False]
    assert scores.rewards == [1.0, 0.0, 1.0, 1.0]
    last_line = scores.first_error.strip().splitlines()[-1]
    assert "MemoryError" in scores.first_error
    assert last_line.startswith("reward call ran out of memory: past data.reward_memory_mb=256 MB"), last_line
    assert "data.reward_memory_mb=256" in caplog.text  # the run's warning names the limit
    assert scores.timeouts == 0  # a failed call, not a time-out
    (pids,) = [v for k, v in scores.extras.items() if "pid" in k]  # the extra each call returned
    assert pids[0] != pids[2] and pids[2] == pids[3]  # the failed call's worker was replaced, the new one kept

    steps = FailedRewardSteps(1)  # a step whose every group failed on memory stops the run, naming the limit
    steps.count(scores.errors, False, scores.first_error)
    with pytest.raises(RunError, match=r"data.max_failed_reward_steps=1\).*data.reward_memory_mb=256"):
        steps.check(1)


def test_a_limit_without_workers_is_refused():
    with pytest.raises(ValueError, match="memory_mb=256 limits the worker processes"):
        score_responses(get_reward_fn("digits"), ["1"], ["1"], timeout_s=None, memory_mb=256)


def test_the_rules_of_data_reward_memory_mb():
    assert load_config(["data.reward_memory_mb=256"]).data.reward_memory_mb == 256  # digits, in workers by default
    assert load_config([]).data.reward_memory_mb is None  # the default: no limit
    load_config([f"data.reward_memory_mb={MEMORY_FLOOR_MB}"])
    assert f"is below {MEMORY_FLOOR_MB} MB" in problems(f"data.reward_memory_mb={MEMORY_FLOOR_MB - 1}")
    assert "data.reward_memory_mb" in problems("data.reward_memory_mb=0")
    message = problems("data.reward_timeout_s=null", "data.reward_memory_mb=256")
    assert "data.reward_memory_mb=256 has no effect" in message and "calls them in the driver" in message
    message = problems("data.reward=http://127.0.0.1:9/score", "data.reward_memory_mb=256")
    assert "data.reward_memory_mb=256 has no effect" in message and "reward service" in message


def test_a_system_that_cannot_enforce_it_is_named(monkeypatch):
    from relax.rewards import worker_pool

    assert worker_pool.memory_limit_problem() is None  # this Linux applies RLIMIT_DATA (the test above shows it)
    monkeypatch.setattr(worker_pool.platform, "release", lambda: "4.4.0-210-generic")
    assert "needs Linux 4.7 or later" in worker_pool.memory_limit_problem()
    monkeypatch.setattr(worker_pool.sys, "platform", "darwin")
    assert "needs Linux" in worker_pool.memory_limit_problem()
