"""Hooks on a MoE model that do not go through `relax.models.moe.RouterControl`: what its routers and experts
modules really receive, the independent side of the routing tests (tests/models/test_moe_families.py,
test_vl_moe.py)."""

from __future__ import annotations

import torch

from relax.models.moe import moe_routers


def observe_moe_blocks(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Hooks independent of RouterControl: each router's input (its hidden states) and each experts module's
    (experts, weights) arguments, the ones the MoE block actually computes with."""
    inputs: list[torch.Tensor] = []
    used: list[tuple[torch.Tensor, torch.Tensor]] = []
    routers = moe_routers(model)
    for router in routers:
        router.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
    for block in model.modules():
        if any(child is r for child in block.children() for r in routers):
            block.experts.register_forward_pre_hook(
                lambda m, args: used.append((args[1].detach().clone(), args[2].detach().clone())))
    return inputs, used
