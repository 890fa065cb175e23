"""The expert-load metrics and the router z-loss (train.moe_z_loss_coef) on the Megatron backend, against the torch
backend (whose metrics tests/models/test_moe_load_and_z_loss.py checks against a brute-force count and a hand
computation) on the same weights and padded batch: DP=2 x EP=2 over gloo, three micro-batches a rank, megatron-core's
own z-loss (moe_z_loss_coeff set for the step, padding_mask from the layout); the `moe_load_z`
scenario of tests/megatron/ranks.py (tests/megatron/moe_scenarios.py), in test_megatron_cpu's shared launch."""

from __future__ import annotations

import importlib.util

import pytest
from test_megatron_cpu import shared_launch  # tests/megatron/test_megatron_cpu.py (this directory is on sys.path)

pytestmark = [pytest.mark.xdist_group("megatron_cpu"), pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                 or importlib.util.find_spec("megatron.core") is None,
                                 reason="megatron-core is not installed (pip install -e '.[megatron]')")]

LOAD = ("train/moe_expert_load_max_over_mean", "train/moe_expert_load_min_over_mean", "train/moe_expert_load_cv",
        "train/moe_expert_load_max_over_mean/layer_0", "train/moe_expert_load_max_over_mean/layer_1")


@pytest.fixture(scope="module")
def load_z(request, tmp_path_factory) -> dict:
    return shared_launch(request, tmp_path_factory)["moe_load_z"]


def test_megatron_expert_load_and_z_loss_equal_the_torch_backends(load_z):
    res = load_z
    steps = res["steps"]
    for key, row in steps.items():
        mega, torch_ = row["megatron"], row["torch"]
        for name in LOAD:  # the same counts: summed over micro-batches and both data-parallel ranks
            assert mega[name] == pytest.approx(torch_[name], rel=1e-12), (key, name)
        assert mega["train/moe_z_loss"] == pytest.approx(res["z_by_hand"], rel=1e-5), key
        assert torch_["train/moe_z_loss"] == pytest.approx(res["z_by_hand"], rel=1e-5), key
        assert mega["train/loss"] == pytest.approx(torch_["train/loss"], rel=1e-5), key
    # train/loss counts coef * z on both backends
    for backend in ("megatron", "torch"):
        on, off = steps["0.1"][backend], steps["0.0"][backend]
        assert on["train/loss"] - off["train/loss"] == pytest.approx(0.1 * res["z_by_hand"], rel=1e-4), backend
    # the gradient's change from coef 0 to 0.1 equals the torch backend's, wherever there is one (the routers and
    # every weight before the last one), and the routers do change
    changed = res["z_grad_change_rel_diff"]
    assert any("mlp.gate.weight" in n for n in changed) and max(changed.values()) < 1e-3, changed
    assert all(res["z_grad_change_norm"][n] > 0 for n in res["z_grad_change_norm"] if "mlp.gate.weight" in n)
    assert res["recompute_grad_rel_diff"] < 1e-5  # activation recompute: the z-loss in the recomputed forward
