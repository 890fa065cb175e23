"""`data.sandbox` (the limits of the code_tests rewards' and the python tool's sandbox) and `data.reward_workers`:
the configured limits reach the sandboxes in the reward and tool worker processes (a program that allocates 600 MB
fails under the default 512 MB and passes under data.sandbox.memory_mb=2048; a program that sleeps 2 s passes by
default and is a counted time-out under data.sandbox.wall_s=1), the number of reward worker processes is the
configured one (counted by the processes that answered), and the rules that compare data.reward_timeout_s and
data.tool_timeout_s with the sandbox's wall-clock limit use the configured value; every problem is reported at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.agents.loops import AgentFactory
from relax.agents.parsers import ToolCall
from relax.config import ConfigError, load_config
from relax.rewards import worker_pool
from relax.rewards.combined import reward_of
from relax.rewards.registry import get_reward_fn, score_responses

HERE = Path(__file__).resolve().parent
BIG = "b = bytearray(600 * 1024 * 1024)\n"  # 600 MB: over the default address-space limit of 512 MB
LABEL = json.dumps({"tests": [{"call": "f(1)", "expected": 601}]})
ALLOCATES = f"```python\ndef f(x):\n    {BIG.strip()}\n    return len(b) // (1024 * 1024) + x\n```"
SLEEPS = "```python\nimport time\ndef f(x):\n    time.sleep(2)\n    return 600 + x\n```"


@pytest.fixture(autouse=True)
def _input_rewards(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # input_rewards:<name>, in this process and in spawned reward workers


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides))
    return str(info.value)


def test_the_configured_limits_reach_the_code_tests_reward_in_its_workers():
    default = reward_of("code_tests", load_config(["data=code_tests"]).data.sandbox)
    roomy = reward_of(["code_tests"], load_config(["data=code_tests", "data.sandbox.memory_mb=2048"]).data.sandbox)
    quick = reward_of("code_tests_all", load_config(["data=code_tests", "data.reward=code_tests_all",
                                                     "data.sandbox.wall_s=1", "data.sandbox.cpu_s=1"]).data.sandbox)
    assert score_responses(default, [ALLOCATES, SLEEPS], [LABEL] * 2, timeout_s=30, workers=1).rewards == [0.0, 1.0]
    assert score_responses(roomy.fns[0], [ALLOCATES], [LABEL], timeout_s=30, workers=1).rewards == [1.0]
    scores = score_responses(quick, [SLEEPS], [LABEL], timeout_s=30, workers=1)
    assert scores.rewards == [0.0] and scores.counts == {"sandbox_runs": 1, "sandbox_timeouts": 1}


def test_the_configured_limits_reach_the_python_tool_in_its_workers():
    def run(*overrides: str) -> str:
        cfg = load_config(["data.tools=[python]", "rollout.max_turns=2", "data.reward=none", "data.env=guess_number",
                           *overrides])
        factory = AgentFactory(None, list(cfg.data.tools), None, cfg.data.tool_timeout_s, sandbox=cfg.data.sandbox)
        try:
            (result,) = factory.runner([ToolCall("python", {"code": BIG + "print(len(b) >> 20)"})])
        finally:
            factory.close()
        return result.content

    assert "MemoryError" in run()
    assert run("data.sandbox.memory_mb=2048").strip() == "600"


@pytest.mark.parametrize("workers", [1, 3])
def test_reward_workers_is_the_number_of_worker_processes(workers):
    fn = get_reward_fn("input_rewards:worker_pid")
    scores = score_responses(fn, ["a"] * 12, ["a"] * 12, timeout_s=30, workers=workers)
    pids = set(scores.extras["rollout/reward/pid_mean"])
    assert worker_pool._POOL.processes == workers and len(worker_pool._POOL._workers) == workers
    assert 1 <= len(pids) <= workers  # (a worker that starts last may find every call taken)
    if workers == 1:
        assert len(pids) == 1


def test_the_time_limits_are_checked_against_the_configured_wall_clock_limit_every_problem_at_once():
    load_config(["data=code_tests", "data.sandbox.wall_s=20", "data.reward_timeout_s=26"])  # 20 + 5 < 26
    message = problems("data=code_tests", "data.sandbox.wall_s=20", "data.reward_timeout_s=24",
                       "data.tools=[python]", "rollout.max_turns=2", "data.tool_timeout_s=21",
                       "data.sandbox.cpu_s=30", "data.sandbox.memory_mb=0")
    assert "data.reward_timeout_s=24.0 must be more than 25 s, the sandbox's wall-clock limit of " \
           "data.reward=code_tests (20 s, data.sandbox.wall_s) plus a 5 s margin" in message
    assert "data.tool_timeout_s=21.0 must be more than 22 s, the python tool's sandbox wall-clock limit (20 s, " \
           "data.sandbox.wall_s) plus a 2 s margin" in message
    assert "data.sandbox.cpu_s=30 exceeds the wall-clock limit of the programs of the code_tests rewards" in message
    assert "data.sandbox.memory_mb=0 must be > 0" in message
    # the defaults: the tool's 5 s (the default data.tool_timeout_s=10 passes), code_tests' 10 s
    assert "must be more than 15 s, the sandbox's wall-clock limit of data.reward=code_tests (10 s) plus a 5 s " \
           "margin" in problems("data=code_tests", "data.reward_timeout_s=12")
    load_config(["data.tools=[python]", "rollout.max_turns=2", "data.sandbox.wall_s=7.5"])  # 7.5 + 2 < 10


@pytest.mark.parametrize("wall, timeout", [(1, 6), (1, 5.5)])
def test_a_time_limit_at_or_under_the_wall_clock_limit_plus_the_margin_says_the_least_it_must_exceed(wall, timeout):
    """The rule is strict (6 s = 1 s + 5 s is refused, 7 s passes), and so is its message: "more than 6 s", not "by
    5 s", which 6 s already does."""
    message = problems("data=code_tests", f"data.sandbox.wall_s={wall}", "data.sandbox.cpu_s=1",
                       f"data.reward_timeout_s={timeout}")
    assert f"data.reward_timeout_s={float(timeout)} must be more than 6 s, the sandbox's wall-clock limit of " \
           "data.reward=code_tests (1 s, data.sandbox.wall_s) plus a 5 s margin" in message
    load_config(["data=code_tests", f"data.sandbox.wall_s={wall}", "data.sandbox.cpu_s=1", "data.reward_timeout_s=7"])
    message = problems("data.tools=[python]", "rollout.max_turns=2", f"data.sandbox.wall_s={wall}",
                       "data.sandbox.cpu_s=1", "data.tool_timeout_s=3")
    assert "data.tool_timeout_s=3.0 must be more than 3 s, the python tool's sandbox wall-clock limit (1 s, " \
           "data.sandbox.wall_s) plus a 2 s margin" in message


def test_options_nothing_reads_are_refused():
    message = problems("data.sandbox.memory_mb=1024", "data.sandbox.wall_s=3", "data.reward_workers=2",
                       "data.reward_timeout_s=null")
    assert "data.sandbox.memory_mb=1024 has no effect" in message and "data.sandbox.wall_s=3.0 has no effect" in \
        message
    assert "data.reward_workers=2 has no effect" in message and "data.reward_timeout_s=null" in message
    assert "data.reward_workers=2 has no effect" in problems("data.reward=http://127.0.0.1:9/score",
                                                             "data.reward_workers=2")
    load_config(["data.reward_workers=2"])  # digits under the default data.reward_timeout_s: in workers


def test_a_run_builds_its_reward_and_its_python_tool_with_the_configured_limits():
    """The wiring of a run: preflight's reward (what the run scores with) and the episodes' python tool."""
    from relax.agents.episode import EpisodeMaker
    from relax.runner.preflight import preflight

    cfg = load_config(["data=code_tests", "data.sandbox.memory_mb=2048", "data.sandbox.wall_s=9",
                       "data.tools=[python]", "rollout.max_turns=2", "data.tool_timeout_s=12"])
    pre = preflight(cfg, only=("reward",))
    assert not pre.problems, pre.render()
    assert (pre.reward_fn.limits.memory_mb, pre.reward_fn.limits.wall_s, pre.reward_fn.limits.cpu_s) == (2048, 9.0, 5)
    maker = EpisodeMaker.for_config(cfg)
    try:
        limits = maker.loops.tools["python"].fn.limits
    finally:
        maker.close()
    assert (limits.memory_mb, limits.wall_s, limits.cpu_s) == (2048, 9.0, 3)


def past_the_floor(**values: float):
    """SandboxLimits holding values under the floors, which the class refuses: set past its check, to show the
    sandbox under them (the floors' reason)."""
    from relax.rewards.sandbox import SandboxLimits

    limits = SandboxLimits()
    for name, value in values.items():
        object.__setattr__(limits, name, value)
    return limits


@pytest.mark.parametrize("field, values", [("memory_mb", (1, 63, 64, 65)), ("wall_s", (0.005, 0.49, 0.5, 0.6))])
def test_the_class_and_the_config_refuse_the_same_values_under_the_floors(field, values):
    """SandboxLimits itself refuses a memory or wall-clock limit under the floor (so a sandbox built in code cannot
    get one), exactly where data.sandbox's rule does: one owner of the floors (relax.sandbox_limits)."""
    from relax.rewards.sandbox import SandboxLimits
    from relax.sandbox_limits import MEMORY_FLOOR_MB, WALL_FLOOR_S

    floor = {"memory_mb": MEMORY_FLOOR_MB, "wall_s": WALL_FLOOR_S}[field]
    assert (MEMORY_FLOOR_MB, WALL_FLOOR_S) == (64, 0.5)  # the values above straddle these
    for value in values:
        try:
            SandboxLimits(**{field: value})
            class_refuses = None
        except ValueError as exc:
            class_refuses = str(exc)
        try:
            load_config(["data=code_tests", f"data.sandbox.{field}={value}"])
            config_refuses = False
        except ConfigError as exc:
            config_refuses = f"data.sandbox.{field}={value} is below {floor:g}" in str(exc)
        assert (class_refuses is not None) == config_refuses == (value < floor), (value, class_refuses)
        if class_refuses is not None:
            assert class_refuses.startswith(f"SandboxLimits.{field}={value} is below {floor:g}"), class_refuses


def test_limits_under_which_the_sandboxed_interpreter_cannot_start_are_refused():
    """data.sandbox.memory_mb and wall_s below what the sandbox's own interpreter needs to start: every program would
    fail before its first line (seen here on the sandbox itself), so the config refuses them, naming the floor."""
    from relax.rewards.sandbox import SandboxLimits, run_in_sandbox
    from relax.sandbox_limits import MEMORY_FLOOR_MB, WALL_FLOOR_S

    code, tests = "def f(x):\n    return x + 1\n", ["assert f(1) == 2"]
    starved = run_in_sandbox(code, tests, limits=past_the_floor(memory_mb=1))
    assert starved.passed == [False] and "MemoryError" in starved.stderr  # before the harness reached the code
    assert run_in_sandbox(code, tests, limits=past_the_floor(wall_s=0.005)).status == "timeout"
    at_floor = run_in_sandbox(code, tests, limits=SandboxLimits(memory_mb=MEMORY_FLOOR_MB))
    assert at_floor.status == "ok" and at_floor.passed == [True]

    message = problems("data=code_tests", "data.sandbox.memory_mb=1", "data.sandbox.wall_s=0.005")
    assert f"data.sandbox.memory_mb=1 is below {MEMORY_FLOOR_MB} MB, the least the sandbox allows" in message
    assert f"data.sandbox.wall_s=0.005 is below {WALL_FLOOR_S:g} s, the least the sandbox allows" in message
    tool = problems("data.tools=[python]", "rollout.max_turns=2", f"data.sandbox.memory_mb={MEMORY_FLOOR_MB - 1}")
    assert f"data.sandbox.memory_mb={MEMORY_FLOOR_MB - 1} is below {MEMORY_FLOOR_MB} MB" in tool
    # the floors themselves pass, for either user; a value nothing reads keeps its own message alone
    load_config(["data=code_tests", f"data.sandbox.memory_mb={MEMORY_FLOOR_MB}", f"data.sandbox.wall_s={WALL_FLOOR_S}"])
    load_config(["data.tools=[python]", "rollout.max_turns=2", f"data.sandbox.memory_mb={MEMORY_FLOOR_MB}"])
    unused = problems("data.sandbox.memory_mb=1")
    assert "data.sandbox.memory_mb=1 has no effect" in unused and "is below" not in unused
