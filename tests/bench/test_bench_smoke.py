"""The performance suite runs end to end at a tiny size and writes a well-formed report (no timing asserted)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes (tests/README.md)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_main(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    pytest.importorskip("trl")
    from bench.run_all import main

    return main


def test_smoke_suite_writes_a_complete_report(bench_main, tmp_path, ray_local):
    # ray_local: the worker's Ray, which the suite's runs share as they share the one it starts when none runs (the
    # worker keeps it for its next Ray test rather than starting another after the suite stops its own)
    out = tmp_path / "perf.md"
    bench_main(["--smoke", "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# Relax performance")
    for heading in ("## Machine", "## Targets", "## RL step throughput", "## Rollout engine vs Hugging Face",
                    "## Train phase vs the machine", "## Actor memory", "## Cost as work grows",
                    "## Overhead of the real Ray loop", "## Training modes", "## rollout=sglang requests",
                    "## Agentic episodes", "## Algorithm math"):
        assert heading in text, heading
    assert "load average" in text and "cpu" in text
    assert "```" not in text, "a section failed"  # tracebacks are fenced
    # every comparison row carries a median ratio and the command that reproduces it
    assert re.search(r"\| tiny \| float32 \| .* \| \*\*[0-9.]+ \([0-9.]+-[0-9.]+, n=\d+\)\*\*", text)
    for script in ("rl_vs_trl.py", "rollout_vs_generate.py", "train_mfu.py", "train_memory.py", "cost_growth.py",
                   "overhead.py", "async_modes.py", "sglang_requests.py", "agent_episodes.py", "algorithm_math.py"):
        assert f"python bench/{script}" in text, script
    assert "m2po_clip_bounds" in text
    # the overhead rows come with their profile: start-up by phase, a step's overhead by part
    assert re.search(r"start-up Ray [0-9.]+ s, roles [0-9.]+ s, rest [0-9.]+ s; a step's overhead weights load "
                     r"[0-9.-]+ ms, generate call [0-9.-]+ ms, reward calls", text)
    # each target row carries its verdict; the headlines are embedded for the next run's comparison
    assert "**met**" in text or "**not met**" in text
    assert "## Against the previous report" in text and "nothing to compare against" in text
    from bench.verdicts import previous

    headlines = previous(text)
    assert headlines is not None and "math m2po_clip_bounds: ms" in headlines.values


def test_the_next_report_flags_what_got_worse(monkeypatch):
    """A headline worse beyond the tolerance, in the direction that matters, is flagged; noise and gains are not."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.verdicts import Headlines, comparison, previous

    before = Headlines()
    before.add("ratio up", 2.0, True)  # higher is better
    before.add("ms down", 10.0, False)  # lower is better
    before.add("ratio noise", 2.0, True)
    before.add("gone", 1.0, True)
    now = Headlines()
    now.add("ratio up", 1.6, True)  # -20%: worse
    now.add("ms down", 8.0, False)  # -20% time: better
    now.add("ratio noise", 1.9, True)  # -5%: within the tolerance
    report = f"# Relax performance\n\n| a | b |\n{before.embed()}\n"
    lines = comparison(previous(report), now, tolerance=0.15)
    assert lines[0] == "Against the report this run replaced: 1 regression(s) beyond 15%."
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ") and "---" not in line}
    assert rows["ratio up"].endswith("| -20% | **regression** |")
    assert rows["ms down"].endswith("| -20% | better |")
    assert rows["ratio noise"].endswith("| -5% |  |")
    assert lines[-1] == "Not measured in this run: gone."
    assert "nothing to compare against" in comparison(previous("# an old report"), now)[0]


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

    from bench import profile_ops

    for phase in (["generate", "--batch", "2", "--n-samples", "2", "--prompt-len", "4", "--new-tokens", "3"],
                  ["train", "--rows", "2", "--prompt-len", "4", "--response-len", "4", "--micro", "2"]):
        profile_ops.main([*phase, "--model", "tiny", "--dtype", "float32", "--reps", "1"])
        last = capsys.readouterr().out.strip().splitlines()[-1]
        shares = json.loads(last)["shares"]
        assert shares["matmul"] > 0 and abs(sum(shares.values()) - 1) < 1e-6, last


def test_datasheet_peaks_match_the_most_specific_name(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.common import datasheet_bf16_flops

    assert datasheet_bf16_flops("NVIDIA H200") == 989.4e12
    assert datasheet_bf16_flops("NVIDIA H100 PCIe") == 756.0e12
    assert datasheet_bf16_flops("NVIDIA H100 80GB HBM3") == 989.4e12  # the SXM part's name
    assert datasheet_bf16_flops("NVIDIA L40S") == 362.0e12  # not the L4's
    assert datasheet_bf16_flops("NVIDIA A100-SXM4-80GB") == 312.0e12
    assert datasheet_bf16_flops("Tesla T4") is None
