"""The `python` tool (relax.agents.python_tool): the model's code runs in the sandbox; a program stopped at a limit is
a tool error that says which limit, and an escape refused by the sandbox answers with the refusal."""

from __future__ import annotations

import pytest

from relax.agents.python_tool import python


def test_a_program_ignoring_sigxcpu_is_reported_as_a_time_out():
    """It ends with the kernel's SIGKILL at RLIMIT_CPU's hard limit: a time-out, not 'stopped (killed)'."""
    with pytest.raises(TimeoutError, match="limit"):
        python("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass")


def test_a_program_killing_itself_is_stopped_not_timed_out():  # the control
    with pytest.raises(RuntimeError, match="stopped \\(killed\\)"):
        python("import os, signal\nsignal.raise_signal(signal.SIGKILL)")


def test_reading_a_file_through_a_directory_fd_answers_with_the_refusal():
    out = python("import os\nd = os.open('/etc', os.O_RDONLY)\nprint(os.read(os.open('hostname', os.O_RDONLY, "
                 "dir_fd=d), 100))")
    assert "refused" in out and "SandboxError" in out, out


def test_printing_works():
    assert python("print(6 * 7)") == "42\n"
