"""The load-balancing loss (train.moe_aux_loss_coef) on the Megatron backend, against the torch backend (whose loss
tests/models/test_moe.py checks against Hugging Face's load_balancing_loss_func) and a hand computation from
transformers' router logits, on the same weights and padded batch: DP=2 x EP=2 over gloo, two micro-batches a rank
holding the same rows as the torch backend's (the loss is a micro-batch's); the torch backend's formula added to each
router (not megatron-core's aux loss), through megatron-core's MoEAuxLossAutoScaler. The `moe_aux`
scenario of tests/megatron/ranks.py (tests/megatron/moe_scenarios.py), in test_megatron_cpu's shared launch."""

from __future__ import annotations

import importlib.util

import pytest
from test_megatron_cpu import shared_launch  # tests/megatron/test_megatron_cpu.py (this directory is on sys.path)

pytestmark = [pytest.mark.xdist_group("megatron_cpu"), pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                 or importlib.util.find_spec("megatron.core") is None,
                                 reason="megatron-core is not installed (pip install -e '.[megatron]')")]

AUX = "train/moe_aux_loss"


@pytest.fixture(scope="module")
def aux(request, tmp_path_factory) -> dict:
    return shared_launch(request, tmp_path_factory)["moe_aux"]


def test_megatron_load_balancing_loss_equals_the_torch_backends_and_a_hand_computation(aux):
    steps = aux["steps"]
    for key in ("0.1", "0.1_recompute"):
        mega, torch_ = steps[key]["megatron"], steps[key]["torch"]
        assert mega[AUX] == pytest.approx(aux["aux_by_hand"], rel=1e-5), key
        assert torch_[AUX] == pytest.approx(aux["aux_by_hand"], rel=1e-5), key
        assert mega["train/loss"] == pytest.approx(torch_["train/loss"], rel=1e-5), key
    # off: not reported on either backend
    assert AUX not in steps["0.0"]["megatron"] and AUX not in steps["0.0"]["torch"]
    # train/loss counts coef * the loss on both backends
    for backend in ("megatron", "torch"):
        on, off = steps["0.1"][backend], steps["0.0"][backend]
        assert on["train/loss"] - off["train/loss"] == pytest.approx(0.1 * aux["aux_by_hand"], rel=1e-4), backend


def test_megatron_load_balancing_gradient_equals_the_torch_backends(aux):
    """The gradient's change from coefficient 0 to 0.1 equals the torch backend's wherever there is one (the routers
    and every weight before the last one), and the routers' does change; the whole gradient too; with activation
    recompute the loss is attached in the recomputed forward: the same gradients."""
    changed = aux["aux_grad_change_rel_diff"]
    assert any("mlp.gate.weight" in n for n in changed) and max(changed.values()) < 1e-3, changed
    assert all(aux["aux_grad_change_norm"][n] > 0 for n in aux["aux_grad_change_norm"] if "mlp.gate.weight" in n)
    assert aux["aux_grad_rel_diff"] < 1e-4
    assert aux["recompute_grad_rel_diff"] < 1e-5


def test_megatron_load_balancing_loss_under_routing_replay_counts_the_replayed_experts(aux):
    """rollout.routing_replay=true: the loss counts the experts used (the engine's), as the torch backend's replay
    does; the same trainer routing on its own (the engine disagrees with it) gives another loss and router gradient."""
    replay = aux["replay"]
    assert abs(replay["megatron"][AUX] - replay["torch"][AUX]) < 1e-6  # fp32 rounding (3e-8 measured)
    assert replay["megatron"]["train/loss"] == pytest.approx(replay["torch"]["train/loss"], rel=1e-5)
    assert aux["megatron_router_grad_rel_diff"] < 1e-4
    # the experts the routers choose themselves: a loss 4e-4 away (a hundred times the agreement above)
    assert abs(replay["megatron_own_routes"][AUX] - replay["torch"][AUX]) > 1e-4
    assert aux["megatron_own_routes_router_grad_rel_diff"] > 1e-2
