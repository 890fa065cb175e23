"""The performance suite on a CUDA device (bench/gpu.sh at smoke sizes): every section it runs there computes on
the GPU and reports so (no timing asserted). The Ray loop's section (overhead) runs where Ray is installed (the
prepared machine, tests/gpu/run.sh), the others on a bare one too (tests/gpu/bare.sh). With RELAX_BARE_DEVICE=cpu
(CI's run of bare.sh, tests/gpu/test_bare_script.py) the same sections but the memory one run on the CPU and report
so."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("RELAX_BARE_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (RELAX_BARE_DEVICE=cpu runs it on the CPU)")]

ROOT = Path(__file__).resolve().parents[2]
HEADINGS = ("## Rollout engine vs Hugging Face", "## Train phase vs the machine", "## Actor memory",
            "## Algorithm math")


def test_the_gpu_sections_run_on_the_gpu(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.run_all import main

    out = tmp_path / "perf_gpu.md"
    ray = importlib.util.find_spec("ray") is not None and DEVICE == "cuda"
    # on the CPU the memory section is tests/bench/test_bench_smoke.py's (train_memory.py in a process of its own, as
    # here); what a bare machine could lack for it is the train section's (the same trainer) or its module's imports
    sections = "rollout,train,memory,math" if DEVICE == "cuda" else "rollout,train,math"
    if DEVICE != "cuda":
        import bench.train_memory  # noqa: F401
    main(["--smoke", "--only", sections + (",overhead" if ray else ""), "--out", str(out)])
    text = out.read_text()
    assert "```" not in text, text[-3000:]  # a section that failed is fenced
    assert all(h in text for h in HEADINGS if DEVICE == "cuda" or h != "## Actor memory"), text[-3000:]
    if DEVICE != "cuda":
        assert re.search(r"\| tiny \| float32 \(float32\), cpu \|", text)  # the trainer's row, on the CPU
        return
    assert "GPU: " + torch.cuda.get_device_name(0) in text
    assert re.search(r"\| tiny \| float32 \(float32\), cuda(:0)? \|", text)  # the trainer's row
    assert "cuda allocated" in text  # the memory rows: the CUDA allocator's peak, not the process's
    assert ("cluster=1xgpu" in text) == ray  # the Ray loop with its roles on the GPU
