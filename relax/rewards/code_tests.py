"""The `code_tests` rewards: run the response's code in the sandbox (`relax.rewards.sandbox`) against the label's unit
tests. `code_tests` is the share of tests passed, `code_tests_all` 1 when every test passes and 0 otherwise.

The label is JSON: {"tests": [...], "prefix": "..." (optional)}, each test a statement ("assert f(2) == 4", its
comparisons and truth tests made to read built-in data only) or {"call": "f(2)", "expected": 4} (compared with the
same type; see `relax.rewards.sandbox`). A data file's label written as an object reaches the reward as its JSON text
(`relax.data.datasets.label_text`). The code is the last fenced block of the response
(```python ... ```) or, without one, the whole response; when it does not define a function itself (no line starting
with `def `) it is appended to the label's prefix (a response "x * 3 + 4" completes "def f(x):\\n    return "; a
leading "return " of the response is dropped). A label that is not such JSON fails the call (a reward error: the
data is wrong, not the response). Each call returns a `RewardValue` counting its sandbox run and whether the run
timed out (`rollout/sandbox_timeout_frac`). A run's `data.sandbox` sets the limits (`CodeTestsReward`, which
`relax.rewards.registry.get_reward_fn` builds for the run; the functions use the defaults, `LIMITS`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from relax.rewards.calls import RewardValue
from relax.rewards.sandbox import SandboxLimits, SandboxResult, run_in_sandbox
from relax.sandbox_limits import code_tests_limits

SANDBOX_RUNS = "sandbox_runs"  # `Scores.counts` keys
SANDBOX_TIMEOUTS = "sandbox_timeouts"
LIMITS = SandboxLimits(**code_tests_limits())  # the defaults (data.reward_timeout_s is checked against the run's)
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def program(response: str, label: str) -> tuple[str, list]:
    """(the code to run, the tests) of a response and its label."""
    try:
        spec = json.loads(label)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"code_tests: the label is not JSON ({exc}): {label!r:.200}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("tests"), list) or not spec["tests"]:
        raise ValueError(f"code_tests: the label needs a non-empty list 'tests': {label!r:.200}")
    prefix = spec.get("prefix", "")
    if not isinstance(prefix, str):
        raise ValueError(f"code_tests: the label's 'prefix' must be a string: {label!r:.200}")
    blocks = _FENCE.findall(response)
    code = blocks[-1] if blocks else response
    if not re.search(r"^\s*def ", code, re.MULTILINE):
        code = code.strip()
        code = prefix + (code[len("return "):] if code.startswith("return ") else code)
    return code, spec["tests"]


def run_tests(response: str, label: str, limits: Optional[SandboxLimits] = None) -> SandboxResult:
    code, tests = program(response, label)
    return run_in_sandbox(code, tests, limits=limits or LIMITS)


def _counted(value: float, result: SandboxResult) -> RewardValue:
    return RewardValue(value, {SANDBOX_RUNS: 1, SANDBOX_TIMEOUTS: int(result.timed_out)})


def code_tests_reward(response: str, label: str) -> RewardValue:
    """The share of the label's tests the response's code passes in the sandbox."""
    result = run_tests(response, label)
    return _counted(result.pass_fraction, result)


def code_tests_all_reward(response: str, label: str) -> RewardValue:
    """1 when the response's code passes every test of the label in the sandbox, else 0."""
    result = run_tests(response, label)
    return _counted(float(bool(result.passed) and all(result.passed)), result)


class CodeTestsReward:
    """`code_tests` (the share of tests passed) or, with `all_tests`, `code_tests_all`, under the sandbox limits of
    `data.sandbox`. Pickles by value (a module-level class), limits included, to the reward worker processes."""

    def __init__(self, all_tests: bool, limits: SandboxLimits):
        self.all_tests, self.limits = all_tests, limits
        self.__name__ = "code_tests_all_reward" if all_tests else "code_tests_reward"  # what messages name it by

    @classmethod
    def for_config(cls, name: str, sandbox: Any) -> CodeTestsReward:
        """The reward `name` (code_tests | code_tests_all) under `sandbox` (`data.sandbox`)."""
        return cls(name == "code_tests_all", SandboxLimits(**code_tests_limits(sandbox)))

    def __call__(self, response: str, label: str) -> RewardValue:
        result = run_tests(response, label, self.limits)
        value = float(bool(result.passed) and all(result.passed)) if self.all_tests else result.pass_fraction
        return _counted(value, result)
