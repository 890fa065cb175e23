"""The Megatron backend skips a non-finite step on every rank alike (two CPU ranks over gloo, data parallel).

The `nonfinite` scenario (tests/megatron/fault_scenarios.py) of test_megatron_cpu's shared launch: these tests start
no rank processes of their own; each rank's results are gathered to rank 0."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "megatron"))
from test_megatron_cpu import shared_launch  # noqa: E402  (tests/megatron/test_megatron_cpu.py)

# the shared launch's group: one xdist worker runs every test that reads it, and launches once
pytestmark = [pytest.mark.xdist_group("megatron_cpu"), pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")]

WORLD = 2


@pytest.fixture(scope="module")
def megatron_nonfinite(request, tmp_path_factory) -> list[dict]:
    """Each rank's results, in rank order."""
    ranks = shared_launch(request, tmp_path_factory)["nonfinite"]["ranks"]
    assert len(ranks) == WORLD
    return ranks


def test_a_nan_in_one_ranks_rows_skips_the_step_on_every_rank(megatron_nonfinite):
    for r in megatron_nonfinite:
        assert r["nan_row"] == {"skipped": 1.0, "batch_values": 1.0, "unchanged": True}


def test_a_nonfinite_norm_on_one_rank_only_skips_the_step_on_every_rank(megatron_nonfinite):
    for r in megatron_nonfinite:
        assert r["one_rank_nan_norm"] == {"skipped": 1.0, "unchanged": True}


def test_the_next_finite_step_is_applied_on_every_rank(megatron_nonfinite):
    for r in megatron_nonfinite:
        assert r["good"] == {"skipped": 0.0, "unchanged": False, "step": 2}
