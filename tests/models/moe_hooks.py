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
