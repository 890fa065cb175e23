"""algorithm.loss_agg_mode on the Megatron backend (TP=1 x DP=2 on CPU processes over gloo) against the torch
backend: three steps of seq-mean-token-sum and seq-mean-token-sum-norm give the same losses, gradient norms and
metrics, the Megatron trainer splitting each step over two data-parallel ranks and one-row micro-batches, the torch
one over three-row micro-batches (tests/megatron/ranks.py, `scenario_agg_dp2`). The loss against a loop by hand:
tests/algorithms/test_loss_agg.py."""

from __future__ import annotations

import importlib.util

import pytest
from test_megatron_cpu import STEP_KEYS, assert_same_steps, launch  # this directory is on sys.path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                 or importlib.util.find_spec("megatron.core") is None,
                                 reason="megatron-core is not installed (pip install -e '.[megatron]')")]


@pytest.fixture(scope="module")
def agg(tmp_path_factory) -> dict:
    return launch("agg_dp2", 2, tmp_path_factory.mktemp("megatron_agg"))["agg_dp2"]


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_dp2_token_sum_modes_step_as_the_torch_backend(agg, mode):
    assert_same_steps(agg[mode], STEP_KEYS)
    assert agg[mode][0]["torch"]["train/grad_norm"] > 0


def test_dp2_norm_divides_the_first_step_by_the_scale_factor(agg):
    """Same weights and batch at step 0: -norm's loss is the plain token sum's / loss_scale_factor (5)."""
    plain, norm = agg["seq-mean-token-sum"][0]["megatron"], agg["seq-mean-token-sum-norm"][0]["megatron"]
    assert norm["train/pg_loss"] == pytest.approx(plain["train/pg_loss"] / 5.0, rel=1e-5)
