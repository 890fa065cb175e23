"""The sandbox's wall-clock limits, one constant each: the sandboxes read them (`relax.rewards.code_tests.LIMITS`,
`relax.agents.python_tool.LIMITS`), and so do the config rules that keep the reward's and the tool's own time limits
(`data.reward_timeout_s`, `data.tool_timeout_s`) above them, so that the two cannot drift apart. The sandbox, not the
worker process that calls it, must be what stops a runaway program: its time-out is a counted result (a reward of 0, a
tool error the model reads), while the worker's is a failed call (a group left out, a worker respawned)."""

from __future__ import annotations

CODE_TESTS_WALL_S = 10.0  # the code_tests rewards' sandbox runs
CODE_TESTS_MARGIN_S = 5.0  # data.reward_timeout_s must exceed CODE_TESTS_WALL_S by this
PYTHON_TOOL = "python"  # its name in data.tools (relax.agents.tools.BUILTIN_TOOLS)
PYTHON_TOOL_WALL_S = 5.0  # the python tool's (data.tools=[python]) sandbox runs
PYTHON_TOOL_CPU_S = 3
PYTHON_TOOL_MARGIN_S = 2.0  # data.tool_timeout_s must exceed PYTHON_TOOL_WALL_S by this
