"""Reward functions for the code_tests end-to-end test, imported by name by the reward worker processes."""

from __future__ import annotations

from relax.rewards.calls import RewardValue
from relax.rewards.code_tests import code_tests_reward
from relax.rewards.sandbox import SandboxLimits, run_in_sandbox

SHORT = SandboxLimits(wall_s=1.0, cpu_s=5)


def loops_on_even_length(response: str, label: str) -> RewardValue:
    """For a response of even length, a program that never ends (stopped at the sandbox's 1 s wall-clock limit: reward
    0, a counted time-out); otherwise the code_tests reward of the response."""
    if len(response) % 2:
        return code_tests_reward(response, label)
    result = run_in_sandbox("while True:\n    pass", [{"call": "f()", "expected": 1}], limits=SHORT)
    return RewardValue(result.pass_fraction, {"sandbox_runs": 1, "sandbox_timeouts": int(result.timed_out)})
