"""The Megatron backend skips a non-finite step on every rank alike (two CPU ranks over gloo, data parallel)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# its tests share module-scoped fixtures: one xdist worker runs them in a row
pytestmark = [pytest.mark.xdist_group("megatron_nonfinite"), pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")]

RANKS = Path(__file__).with_name("megatron_ranks.py")
WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("megatron_skip")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(RANKS), str(r), str(WORLD), str(port), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    found = [json.loads(f.read_text()) if (f := out / f"result{r}.json").is_file() else {} for r in range(WORLD)]
    if any(p.returncode for p in procs) or any("error" in r or not r for r in found):
        pytest.fail("\n".join(f"--- rank {r} ---\n{found[r].get('error', '')}\n{log[-3000:]}"
                              for r, log in enumerate(logs)))
    return found


def test_a_nan_in_one_ranks_rows_skips_the_step_on_every_rank(results):
    for r in results:
        assert r["nan_row"] == {"skipped": 1.0, "batch_values": 1.0, "unchanged": True}


def test_a_nonfinite_norm_on_one_rank_only_skips_the_step_on_every_rank(results):
    for r in results:
        assert r["one_rank_nan_norm"] == {"skipped": 1.0, "unchanged": True}


def test_the_next_finite_step_is_applied_on_every_rank(results):
    for r in results:
        assert r["good"] == {"skipped": 0.0, "unchanged": False, "step": 2}
