"""The performance suite on a CUDA device (bench/gpu.sh at smoke sizes): every section it runs there computes on
the GPU and reports so (no timing asserted). The Ray loop's section (overhead) runs where Ray is installed (the
prepared machine, tests/gpu/run.sh), the others on a bare one too (tests/gpu/bare.sh)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_sections_run_on_the_gpu(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.run_all import main

    out = tmp_path / "perf_gpu.md"
    ray = importlib.util.find_spec("ray") is not None
    main(["--smoke", "--only", "rollout,train,memory,math" + (",overhead" if ray else ""), "--out", str(out)])
    text = out.read_text()
    assert "```" not in text, "a section failed"
    assert "GPU: " + torch.cuda.get_device_name(0) in text
    assert re.search(r"\| tiny \| float32 \(float32\), cuda(:0)? \|", text)  # the trainer's row
    assert "cuda allocated" in text  # the memory rows: the CUDA allocator's peak, not the process's
    assert ("cluster=1xgpu" in text) == ray  # the Ray loop with its roles on the GPU
