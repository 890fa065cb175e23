"""`data.reward_workers` in a real run (the tiny model, two steps, roles in this process): with 2 reward worker
processes the run's rewards, and so what it trains, equal those of the same run scoring in the driver
(`data.reward_timeout_s=null`, the calls made one after the other in this process). The reward
(`pid_rewards:digits_with_pid`, the digits reward) records each call with the process that made it: in the worker
run every call was made by one of the pool's 2 processes, each of them (a barrier in the reward makes both take
calls), none by the driver; in the driver run every call was made here. Each recorded value is the digits reward of
its response, recomputed here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from relax.config import load_config
from relax.rewards import worker_pool
from relax.rewards.digits import digits_reward
from relax.runner.train import run

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
STEPS = 2


def _calls(directory: Path) -> list[dict]:
    """The calls recorded since the last read, which it removes."""
    calls = []
    for file in sorted(directory.glob("calls-*.jsonl")):
        calls += [json.loads(line) for line in file.read_text().splitlines()]
    for file in directory.iterdir():
        file.unlink()
    return calls


@pytest.fixture
def trained_rewards(monkeypatch) -> dict[int, list[float]]:
    """step -> the rewards the training loop trained on at that step (of the last run in this process), recorded where
    it hands a step's scored rollout to the trainer side (`relax.runner.train.train_batch`)."""
    from relax.runner import train

    rewards: dict[int, list[float]] = {}
    original = train.train_batch

    def record(cfg, plan, cluster, samples, step_rewards, keep, step):
        rewards[step] = step_rewards.tolist()
        return original(cfg, plan, cluster, samples, step_rewards, keep, step)

    monkeypatch.setattr(train, "train_batch", record)
    return rewards


def test_two_reward_workers_score_as_the_driver_does(in_process, small_run, tmp_path, trained_rewards, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # pid_rewards, in this process and in the reward workers (its sys.path)
    records = tmp_path / "calls"
    records.mkdir()
    monkeypatch.setenv("RELAX_TEST_REWARD_DIR", str(records))
    common = ["data.reward=pid_rewards:digits_with_pid", "cluster.cpus_per_node=1"]

    def trained() -> list[list[float]]:
        assert sorted(trained_rewards) == list(range(STEPS))
        return [trained_rewards.pop(step) for step in range(STEPS)]

    driver = run(load_config(small_run(*common, "data.reward_timeout_s=null", steps=STEPS)), output_dir=tmp_path / "a")
    driver_rewards = trained()
    driver_calls = _calls(records)
    assert {c["pid"] for c in driver_calls} == {os.getpid()}

    monkeypatch.setenv("RELAX_TEST_REWARD_BARRIER", "2")  # read by the workers, started by this run
    monkeypatch.setenv("RELAX_TEST_DRIVER_PID", str(os.getpid()))  # calls made here (wrongly) do not wait
    try:
        workers = run(load_config(small_run(*common, "data.reward_workers=2", steps=STEPS)),
                      output_dir=tmp_path / "b")
        pool = {w.process.pid for w in worker_pool._POOL._workers} if worker_pool._POOL is not None else set()
        worker_calls = _calls(records)
        assert trained() == driver_rewards  # what each step trained on, sample by sample
        assert {c["pid"] for c in worker_calls} == pool and len(pool) == 2 and os.getpid() not in pool
    finally:
        if worker_pool._POOL is not None:  # its workers hold the barrier's setting: not for another test
            worker_pool._POOL.close()
            worker_pool._POOL = None

    assert len(worker_calls) == len(driver_calls) == sum(len(r) for r in driver_rewards)
    for calls in (driver_calls, worker_calls):
        assert all(c["reward"] == digits_reward(c["response"], c["label"]) for c in calls)
    assert sorted((c["response"], c["label"], c["reward"]) for c in worker_calls) == \
        sorted((c["response"], c["label"], c["reward"]) for c in driver_calls)
    assert 0 < len({c["reward"] for c in driver_calls}) > 1  # rewards that differ: the comparison compares something
    for (step_a, a), (step_b, b) in zip(driver.history, workers.history, strict=True):
        assert step_a == step_b
        for key in ("rollout/raw_reward", "train/loss"):
            assert b[key] == a[key], (step_a, key)


def test_a_reward_workers_interpreter_imports_neither_hydra_nor_relax_config():
    """A reward worker is a fresh interpreter per worker and per run (relax.rewards.worker_pool): what its start
    imports is paid again each time. It needs the reward code and the sandbox's limits (relax.sandbox_limits, below
    every layer), not relax.config, whose package imports Hydra and OmegaConf (was: code_tests -> the limits in
    relax.config -> Hydra, most of a worker's start)."""
    import subprocess
    import sys

    probe = ("import sys; from relax.rewards.worker_pool import _worker_main; "
             "print(sorted(m for m in ('hydra', 'omegaconf', 'relax.config', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
