"""A command's exit sets its objects aside instead of collecting them (relax/cli/__init__.py): garbage left at exit
is not finalized, except where triton is loaded, whose extension would report every surviving instance as a leak.
Each case is a fresh interpreter: what its final garbage collection does is the behaviour under test."""

from __future__ import annotations

import subprocess
import sys

import pytest

# a cycle (only the collector frees it) whose finalizer says so, left as garbage when the interpreter exits
CYCLE = ("class Cycle:\n"
         "    def __del__(self):\n"
         "        print('collected', flush=True)\n"
         "c = Cycle(); c.me = c; del c\n")


def _exit_output(prelude: str) -> str:
    proc = subprocess.run([sys.executable, "-c", prelude + CYCLE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_commands_exit_leaves_garbage_uncollected():
    assert "collected" not in _exit_output("import relax.cli\n")


def test_without_the_commands_hook_the_exit_collects_it():
    """The negative control: the same garbage is collected (its finalizer prints) where relax.cli is not imported."""
    assert "collected" in _exit_output("")


def test_where_triton_is_loaded_the_exit_collects_as_usual():
    pytest.importorskip("triton")
    assert "collected" in _exit_output("import relax.cli\nimport triton\n")
