"""The `python` tool (`data.tools=[python]`): the model's code runs in the sandbox of `relax.rewards.sandbox` (a fresh
process with CPU, memory, file-size, process and wall-clock limits, its own temporary directory, no network where the
OS allows) and the tool's result is what it printed. Code that raises answers with its stdout and the error; code
stopped at a limit raises here, so the call counts as a tool error (its message goes back to the model)."""

from __future__ import annotations

from relax.config.sandbox_limits import PYTHON_TOOL_CPU_S, PYTHON_TOOL_WALL_S
from relax.rewards.sandbox import SandboxLimits, run_in_sandbox

# data.tool_timeout_s must exceed wall_s (checked before start: relax.config.validate), so that the
# sandbox, not the tool's worker, stops a runaway program
LIMITS = SandboxLimits(wall_s=PYTHON_TOOL_WALL_S, cpu_s=PYTHON_TOOL_CPU_S, output_bytes=16 * 1024)
MAX_RESULT_CHARS = 2000  # of the output sent back to the model


def python(code: str) -> str:
    """Run `code` in the sandbox; its stdout (and, when it raised, the error), trimmed to MAX_RESULT_CHARS."""
    result = run_in_sandbox(str(code), limits=LIMITS)
    if result.timed_out:
        raise TimeoutError(f"the program ran past the sandbox's limit ({LIMITS.wall_s:g} s wall-clock, "
                           f"{LIMITS.cpu_s} s CPU)")
    if result.status in ("output_limit", "file_size_limit", "killed"):
        raise RuntimeError(f"the program was stopped ({result.status.replace('_', ' ')})")
    text = result.stdout
    if result.status == "error":
        if text and not text.endswith("\n"):  # the error on a line of its own, not glued to the output's last line
            text += "\n"
        text += result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "the program failed"
    text = text if text.strip() else "(no output)"
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + "... (trimmed)"
