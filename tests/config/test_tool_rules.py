"""Tools need a second turn (data.tools with rollout.max_turns=1 is refused: the model would never read a result), and
data.tool_timeout_s must leave room for the python tool's sandbox limit, read from the one constant the sandbox reads
too (relax.sandbox_limits)."""

from __future__ import annotations

import pytest

from relax.config import ConfigError, load_config
from relax.sandbox_limits import CODE_TESTS_WALL_S, PYTHON_TOOL_CPU_S, PYTHON_TOOL_WALL_S


@pytest.mark.parametrize("tools", ["[python]", "[calculator]", "[calculator,python]"])
def test_tools_with_one_turn_are_refused_naming_both_options(tools):
    with pytest.raises(ConfigError) as err:
        load_config([f"data.tools={tools}"])
    text = str(err.value)
    assert "rollout.max_turns=1: the model never reads a tool's result" in text
    assert "data.tools=" in text and "rollout.max_turns >= 2" in text
    # with an environment too: a turn that calls a tool is answered by the tool, never by the environment
    with pytest.raises(ConfigError, match="never reads a tool's result"):
        load_config([f"data.tools={tools}", "data.env=guess_number"])
    load_config([f"data.tools={tools}", "rollout.max_turns=2"])


def test_the_shipped_tool_config_passes():
    assert load_config(["data=calculator"]).rollout.max_turns == 3


@pytest.mark.parametrize("timeout, ok", [(3, False), (PYTHON_TOOL_WALL_S, False), (7, False), (7.5, True),
                                         (10, True), (None, True)])
def test_the_tool_time_limit_must_be_more_than_the_python_sandbox_s_plus_its_margin(timeout, ok):
    over = ["data.tools=[python]", "rollout.max_turns=2",
            f"data.tool_timeout_s={'null' if timeout is None else timeout}"]
    if ok:
        load_config(over)
        return
    with pytest.raises(ConfigError, match=r"must be more than 7 s, the python tool's sandbox wall-clock limit "
                                          r"\(5 s\) plus a 2 s margin"):
        load_config(over)
    load_config(["data.tools=[calculator]", "rollout.max_turns=2", f"data.tool_timeout_s={timeout}"])  # no sandbox


def test_the_rules_and_the_sandboxes_read_the_same_constants():
    from relax.agents import python_tool
    from relax.rewards import code_tests

    assert (python_tool.LIMITS.wall_s, python_tool.LIMITS.cpu_s) == (PYTHON_TOOL_WALL_S, PYTHON_TOOL_CPU_S)
    assert code_tests.LIMITS.wall_s == CODE_TESTS_WALL_S
    assert load_config([]).data.tool_timeout_s > PYTHON_TOOL_WALL_S  # the default passes with python


def test_python_tool_puts_the_error_on_its_own_line():
    from relax.agents.python_tool import python

    error = "the code raised: solution, line 1: ZeroDivisionError: division by zero"
    assert python('print(1, end=""); 1/0') == "1\n" + error  # was "1the code raised: ..."
    assert python("print(1); 1/0") == "1\n" + error
    assert python("1/0") == error
