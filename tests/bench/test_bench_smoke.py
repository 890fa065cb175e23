"""The performance suite runs end to end at a tiny size and writes a well-formed report (no timing asserted)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_main(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    pytest.importorskip("trl")
    from bench.run_all import main

    return main


def test_smoke_suite_writes_a_complete_report(bench_main, tmp_path):
    out = tmp_path / "perf.md"
    bench_main(["--smoke", "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# Relax performance")
    for heading in ("## Machine", "## Targets", "## RL step throughput", "## Rollout engine vs Hugging Face",
                    "## Train phase vs the machine", "## Actor memory", "## Overhead of the real Ray loop",
                    "## Training modes", "## rollout=sglang requests", "## Algorithm math"):
        assert heading in text, heading
    assert "load average" in text and "cpu" in text
    assert "```" not in text, "a section failed"  # tracebacks are fenced
    # every comparison row carries a median ratio and the command that reproduces it
    assert re.search(r"\| tiny \| float32 \| .* \| \*\*[0-9.]+ \([0-9.]+-[0-9.]+, n=\d+\)\*\*", text)
    for script in ("rl_vs_trl.py", "rollout_vs_generate.py", "train_mfu.py", "train_memory.py", "overhead.py",
                   "async_modes.py", "sglang_requests.py", "algorithm_math.py"):
        assert f"python bench/{script}" in text, script
    assert "m2po_clip_bounds" in text


def test_smoke_needs_an_explicit_output(bench_main):
    with pytest.raises(SystemExit):
        bench_main(["--smoke"])


def test_scripts_keep_their_command_lines(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import algorithm_math

    monkeypatch.setattr(sys, "argv", ["algorithm_math.py", "--tokens", "1024", "--seq-len", "256", "--reps", "1"])
    algorithm_math.main()
    assert "m2po_clip_bounds" in capsys.readouterr().out

    from bench import rollout_vs_generate

    argv = ["rollout_vs_generate.py", "--model", "tiny", "--batch", "2", "--prompt-len", "4", "--new-tokens", "2",
            "--reps", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    rollout_vs_generate.main()
    assert "ratio: median" in capsys.readouterr().out
