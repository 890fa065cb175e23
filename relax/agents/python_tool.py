"""The `python` tool (`data.tools=[python]`): the model's code runs in the sandbox of `relax.rewards.sandbox` (a fresh
process with CPU, memory, file-size, process and wall-clock limits, its own temporary directory, no network where the
OS allows) and the tool's result is what it printed. Code that raises answers with its stdout and the error; code
stopped at a limit raises here, so the call counts as a tool error (its message goes back to the model)."""

from __future__ import annotations

from typing import Any, Optional

from relax.rewards.sandbox import SandboxLimits, run_in_sandbox
from relax.sandbox_limits import python_tool_limits

OUTPUT_BYTES = 16 * 1024
# the defaults; a run's data.sandbox sets its own (`PythonTool`). data.tool_timeout_s must exceed wall_s (checked
# before start: relax.config.validate), so that the sandbox, not the tool's worker, stops a runaway program
LIMITS = SandboxLimits(**python_tool_limits(), output_bytes=OUTPUT_BYTES)
MAX_RESULT_CHARS = 2000  # of the output sent back to the model


def python(code: str, limits: Optional[SandboxLimits] = None) -> str:
    """Run `code` in the sandbox (`limits`: None, the defaults); its stdout (and, when it raised, the error), trimmed
    to MAX_RESULT_CHARS."""
    limits = limits or LIMITS
    result = run_in_sandbox(str(code), limits=limits)
    if result.timed_out:
        raise TimeoutError(f"the program ran past the sandbox's limit ({limits.wall_s:g} s wall-clock, "
                           f"{limits.cpu_s} s CPU)")
    if result.status in ("output_limit", "file_size_limit", "killed"):
        raise RuntimeError(f"the program was stopped ({result.status.replace('_', ' ')})")
    text = result.stdout
    if result.status == "error":
        if text and not text.endswith("\n"):  # the error on a line of its own, not glued to the output's last line
            text += "\n"
        text += result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "the program failed"
    text = text if text.strip() else "(no output)"
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + "... (trimmed)"


class PythonTool:
    """The python tool under the limits of `data.sandbox` (`for_config`): `fn(code=...)`, as `python`. Pickles by
    value (a module-level class), limits included, to the tool worker processes."""

    def __init__(self, limits: SandboxLimits):
        self.limits = limits
        self.__name__ = "python"

    @classmethod
    def for_config(cls, sandbox: Any) -> PythonTool:
        return cls(SandboxLimits(**python_tool_limits(sandbox), output_bytes=OUTPUT_BYTES))

    def __call__(self, code: str) -> str:
        return python(code, self.limits)
