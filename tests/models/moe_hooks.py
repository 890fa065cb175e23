"""Tiny MoE models for the routing tests (`tiny_moe_model`), and hooks on a MoE model that do not go through
`relax.models.moe.RouterControl`: what its routers and experts modules really receive, the independent side of the
routing tests (tests/models/test_moe_families.py, test_vl_moe.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from relax.models.moe import moe_routers


def tiny_moe_model(config: Any, init: Callable[[torch.nn.Module], None], seed: int = 0) -> torch.nn.Module:
    """The model of a (tiny) transformers `config`, built with `from_config` in fp32 with eager attention, in eval
    mode, its weights drawn from `seed` in a forked RNG (the caller's stream untouched); then `init(router)` on each
    MoE router, without autograd and in the same RNG stream, for how the test wants its routers (far from ties, off
    the bf16 grid, with a nonzero selection bias, ...)."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        with torch.no_grad():
            for router in moe_routers(model):
                init(router)
    return model


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


def hand_group_topk(router: torch.nn.Module, hidden: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [M, k] sorted, margin [M]) of DeepSeek-V3's group-limited choice computed by hand in fp64 from the
    router's input `hidden` with `weight` and `bias`: s = sigmoid(h W^T) + bias, the topk_group groups of largest
    top-2 sum, the top-k within them (the router's num_group, num_experts, topk_group, top_k); margin: the k-th chosen
    score minus the best one left out (near 0: a tie that rounding may break either way)."""
    h = hidden.reshape(-1, weight.shape[1]).double()
    s = torch.sigmoid(h @ weight.detach().double().T) + bias.detach().double()
    G, E, k = router.num_group, router.num_experts, router.top_k
    groups = s.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(groups).scatter_(1, groups.topk(router.topk_group, dim=-1).indices, 1.0)
    s = s.masked_fill(keep.repeat_interleave(E // G, dim=1) == 0, float("-inf"))
    top = s.topk(k + 1, dim=-1)
    return top.indices[:, :k].sort(-1).values, top.values[:, k - 1] - top.values[:, k]
