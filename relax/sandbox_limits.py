"""The sandbox's limits: each user's built-in defaults, and the limits a run's `data.sandbox` sets. The sandboxes
read them (the code_tests rewards, `relax.rewards.code_tests`; the python tool, `relax.agents.python_tool`), and so do
the config rules that keep the reward's and the tool's own time limits (`data.reward_timeout_s`,
`data.tool_timeout_s`) above the sandbox's wall-clock limit, so that the two cannot drift apart. The sandbox, not the
worker process that calls it, must be what stops a runaway program: its time-out is a counted result (a reward of 0,
a tool error the model reads), while the worker's is a failed call (a group left out, a worker respawned).

Pure constants and two small functions: this module imports nothing of Relax and sits below every layer (as
relax/metrics.py does), so that the processes that only run rewards or sandboxes (relax.rewards.worker_pool's
workers) do not import relax.config, whose package imports Hydra."""

from __future__ import annotations

from typing import Any

CODE_TESTS_WALL_S = 10.0  # the code_tests rewards' sandbox runs, unless data.sandbox.wall_s is set
CODE_TESTS_CPU_S = 5
CODE_TESTS_MARGIN_S = 5.0  # data.reward_timeout_s must be more than the code_tests wall-clock limit plus this
PYTHON_TOOL = "python"  # its name in data.tools (relax.agents.tools.BUILTIN_TOOLS)
PYTHON_TOOL_WALL_S = 5.0  # the python tool's (data.tools=[python]) sandbox runs, unless data.sandbox.wall_s is set
PYTHON_TOOL_CPU_S = 3
PYTHON_TOOL_MARGIN_S = 2.0  # data.tool_timeout_s must be more than the python tool's wall-clock limit plus this
# The least data.sandbox.memory_mb and data.sandbox.wall_s may be: a sandboxed program runs in a fresh interpreter
# that starts and sets up its isolation under these limits, so below what that takes every program fails before its
# first line (a MemoryError; a time-out) and every code_tests reward or python tool call with it. The interpreter
# and the harness need about 20 MB of address space (RLIMIT_AS): the floor leaves room for other builds and for the
# program itself. The wall-clock floor is many times a start's duration on an idle machine, for a loaded one.
MEMORY_FLOOR_MB = 64
WALL_FLOOR_S = 0.5


def code_tests_limits(sandbox: Any = None) -> dict[str, Any]:
    """The code_tests rewards' limits (`relax.rewards.sandbox.SandboxLimits` keywords) under `sandbox`
    (`data.sandbox`; None: the defaults)."""
    return _limits(sandbox, CODE_TESTS_WALL_S, CODE_TESTS_CPU_S)


def python_tool_limits(sandbox: Any = None) -> dict[str, Any]:
    """The python tool's limits (`SandboxLimits` keywords) under `sandbox` (`data.sandbox`; None: the defaults)."""
    return _limits(sandbox, PYTHON_TOOL_WALL_S, PYTHON_TOOL_CPU_S)


def _limits(sandbox: Any, wall_s: float, cpu_s: int) -> dict[str, Any]:
    if sandbox is None:
        return {"wall_s": wall_s, "cpu_s": cpu_s}
    return {"wall_s": wall_s if sandbox.wall_s is None else float(sandbox.wall_s),
            "cpu_s": cpu_s if sandbox.cpu_s is None else int(sandbox.cpu_s),
            "memory_mb": int(sandbox.memory_mb), "file_size_mb": float(sandbox.file_size_mb),
            "files_written": int(sandbox.files_written)}
