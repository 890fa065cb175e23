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
timed out (`rollout/sandbox_timeout_frac`).
"""

from __future__ import annotations

import json
import re

from relax.config.sandbox_limits import CODE_TESTS_WALL_S
from relax.rewards.calls import RewardValue
from relax.rewards.sandbox import SandboxLimits, SandboxResult, run_in_sandbox

SANDBOX_RUNS = "sandbox_runs"  # `Scores.counts` keys
SANDBOX_TIMEOUTS = "sandbox_timeouts"
LIMITS = SandboxLimits(wall_s=CODE_TESTS_WALL_S)  # data.reward_timeout_s is checked against it
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


def run_tests(response: str, label: str) -> SandboxResult:
    code, tests = program(response, label)
    return run_in_sandbox(code, tests, limits=LIMITS)


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
