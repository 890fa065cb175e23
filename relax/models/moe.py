"""Mixture-of-experts models: control of the routers, the MoE losses and the expert-load metrics.

Which models: those whose routers belong to a registered family (`relax.models.moe_families.FAMILIES`: Qwen3-MoE
and Qwen2-MoE, Mixtral, gpt-oss, DeepSeek-V3 and GLM-4.5; the family says how to read its router's output and how to
recompute the weights of given experts). `model.arch=qwen3_moe` builds a Qwen3-MoE model from config; the others are
read from files (`model.source=hf`).

`RouterControl` puts one forward hook on every router of a model (once; `router_control(model)`), which does
nothing until asked to:

- record: keep the top-k expert ids each router chose (the rollout engine, `relax.rollout.routes`);
- compare / force (`arm`): given the engine's experts of every token and layer, count how often the router's own
  choice equals them and, forcing, route each token to exactly the engine's experts, with the weights recomputed
  from this model's own router scores over those experts by the family's formula (`RouterFamily.weights`): rollout
  routing replay (R3), as megatron-core's `RouterReplay` and slime do. The weights keep their gradient through the
  scores; the choice itself has none, forced or not;
- collect the router logits and the experts used in a training forward: the load-balancing loss
  (`load_balancing_loss`, over the family's `aux_scores`), the router z-loss (`z_loss_sum`) and the expert-load
  metrics (`expert_counts`, `expert_load_metrics`).

Routes travel compactly (`route_dtype`): uint8 for up to 255 experts, else int16; a token without a recorded route
(padding, a token never fed to the engine) holds `route_fill(dtype)`, which `recorded_mask` reads back as missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from relax.metrics import MOE_LOAD_CV, MOE_LOAD_MAX_OVER_MEAN, MOE_LOAD_MIN_OVER_MEAN, moe_layer_load
from relax.models.gguf_cache import gguf_config
from relax.models.moe_families import (
    ROUTED_MODEL_TYPES,
    SELECTION_BIAS_MODEL_TYPES,
    RouterFamily,
    dense_among_sparse,
    dense_among_sparse_message,
    family_of_model_type,
    router_families,
    softmax_scores,
)


def _router_classes() -> tuple[type, ...]:
    return tuple(router_families())


def router_family(router: nn.Module) -> RouterFamily:
    """The registered family of one router module (a subclass of a registered class: its base's); KeyError for a
    class no family registers."""
    families = router_families()
    for cls in type(router).__mro__:
        if cls in families:
            return families[cls]
    raise KeyError(type(router).__name__)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of `model`'s sparse MoE layers, in layer order (empty for a dense model)."""
    classes = _router_classes()
    return [m for m in model.modules() if isinstance(m, classes)]


def is_moe(model: nn.Module) -> bool:
    return bool(moe_routers(model))


def route_dtype(num_experts: int) -> torch.dtype:
    """The dtype routes travel in: uint8 up to 255 experts (255 marks a missing route), else int16 (-1 does)."""
    return torch.uint8 if num_experts < 255 else torch.int16


def route_fill(dtype: torch.dtype) -> int:
    """The value of a missing route in `dtype`."""
    return 255 if dtype == torch.uint8 else -1


def recorded_mask(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[...] bool over routes [..., k]: True where a route was recorded (every one of its k ids an expert)."""
    r = routes.long()
    return ((r >= 0) & (r < num_experts)).all(-1)


def load_balancing_loss(logits: torch.Tensor, experts: torch.Tensor, valid: Optional[torch.Tensor],
                        num_experts: int, top_k: int,
                        scores: Callable[[torch.Tensor], torch.Tensor] = softmax_scores) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of one MoE layer, normalised as megatron-core's (1 when balanced):
    E / k * sum_e f_e P_e, f_e = (tokens routed to e) / n, P_e = mean router score of e, over the n valid
    tokens. logits [M, E] (with their gradient), experts [M, k] (the ones used), valid [M] bool or None (all);
    `scores`: the router family's scores of the logits (`RouterFamily.aux_scores`: softmax, or for a sigmoid router
    the sigmoid over its sum)."""
    probs = scores(logits)
    if valid is not None:
        probs, experts = probs[valid], experts[valid]
    n = max(1, probs.shape[0])
    counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(0, experts.reshape(-1).long(), torch.ones(experts.numel(), device=logits.device))
    return num_experts / top_k * ((counts / n) * (probs.sum(0) / n)).sum()


def z_loss_sum(logits: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's router z-loss of one MoE layer, summed (not averaged) over its valid tokens: sum_n
    logsumexp(z_n)^2, fp32, with its gradient; logits [M, E], valid [M] bool or None (all). The caller divides by the
    step's tokens and MoE layers, so that micro-batches and data-parallel ranks add up to the step's mean."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    if valid is not None:
        lse = lse[valid]
    return lse.square().sum()


def expert_counts(experts: torch.Tensor, valid: Optional[torch.Tensor], num_experts: int) -> torch.Tensor:
    """[E] float64: how many of the valid tokens each expert got, from the experts used [M, k] (valid [M] bool or
    None: all)."""
    if valid is not None:
        experts = experts[valid]
    return torch.bincount(experts.reshape(-1).long().cpu(), minlength=num_experts).double()


def expert_load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """The expert-load metrics (`relax.metrics.MOE_LOAD_*`) of a step's counts [MoE layers, E] (tokens each layer
    routed to each expert, summed over micro-batches and ranks): per layer max / mean and min / mean of the experts'
    loads and their coefficient of variation; max_over_mean is the worst (largest) layer's, min_over_mean the worst
    (smallest) layer's, cv the mean over layers; and each layer's max_over_mean (`moe_layer_load`). Layers that
    routed no token are left out ({} if none did)."""
    counts = counts.double()
    mean = counts.mean(-1)
    used = mean > 0
    if not bool(used.any()):
        return {}
    mean = mean.clamp_min(1e-300)
    top = counts.max(-1).values / mean
    low = counts.min(-1).values / mean
    cv = counts.std(-1, correction=0) / mean
    out = {MOE_LOAD_MAX_OVER_MEAN: float(top[used].max()), MOE_LOAD_MIN_OVER_MEAN: float(low[used].min()),
           MOE_LOAD_CV: float(cv[used].mean())}
    out |= {moe_layer_load(i): float(top[i]) for i in range(len(counts)) if bool(used[i])}
    return out


class RouterControl:
    """Forward hooks on every router of one model (see the module docstring); one per model: `router_control`."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router")
        first = self.routers[0]
        self.family = router_family(first)
        if any(router_family(r) is not self.family for r in self.routers):
            raise ValueError(f"{type(model).__name__} mixes routers of several families")
        self.num_layers = len(self.routers)
        self.top_k, self.num_experts = int(first.top_k), int(first.num_experts)
        self.recording = False
        self.recorded: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._engine: Optional[torch.Tensor] = None  # [M, L, k] long, -1 where missing
        self._force = False
        self._collect = False
        self.logits: list[Optional[torch.Tensor]] = [None] * self.num_layers
        self.used: list[Optional[torch.Tensor]] = [None] * self.num_layers
        # (token-layers compared, whose used experts equal the engine's, whose own choice does)
        self.counts = torch.zeros(3, dtype=torch.float64)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def arm(self, engine: Optional[torch.Tensor], *, force: bool, collect: bool) -> None:
        """The next forwards compare with (and, `force`, use) `engine` [M, L, k] (the engine's experts of the M
        tokens of the forward in the order the routers see them; entries < 0 or >= E: none recorded), and with
        `collect` keep each layer's logits and experts used."""
        if engine is not None and tuple(engine.shape[1:]) != (self.num_layers, self.top_k):
            raise ValueError(f"routes of shape {tuple(engine.shape)}: this model has {self.num_layers} MoE layers of "
                             f"top-{self.top_k} routing")
        self._engine, self._force, self._collect = engine, force and engine is not None, collect
        self.logits = [None] * self.num_layers
        self.used = [None] * self.num_layers

    def disarm(self) -> None:
        self._engine, self._force, self._collect = None, False, False

    def take_counts(self) -> torch.Tensor:
        counts, self.counts = self.counts, torch.zeros(3, dtype=torch.float64)
        return counts

    def _hook(self, layer: int):
        def hook(module: nn.Module, inputs: tuple, output: tuple) -> Optional[tuple]:
            logits, scores, chosen = self.family.read(output)
            if self.recording:
                self.recorded[layer].append(chosen.detach())
            if self._engine is None and not self._collect:
                return None
            used = chosen
            if self._engine is not None:
                engine = self._engine[:, layer].to(chosen.device)
                if engine.shape[0] != chosen.shape[0]:
                    raise ValueError(f"MoE layer {layer}: {engine.shape[0]} recorded routes for {chosen.shape[0]} "
                                     "tokens")
                known = ((engine >= 0) & (engine < self.num_experts)).all(-1)
                if self._force:
                    used = torch.where(known[:, None], engine, chosen)
                    scores = self.family.weights(module, logits, used)
                with torch.no_grad():
                    want = engine[known].sort(-1).values
                    same_used = (used[known].sort(-1).values == want).all(-1)
                    same_own = (chosen[known].sort(-1).values == want).all(-1)
                    self.counts += torch.tensor([float(known.sum()), float(same_used.sum()), float(same_own.sum())],
                                                dtype=torch.float64)
            if self._collect:
                self.logits[layer], self.used[layer] = logits, used
            return self.family.write(output, scores, used)

        return hook


def router_control(model: nn.Module) -> RouterControl:
    """The `RouterControl` of `model`, made (and its hooks put on) the first time."""
    control = getattr(model, "_relax_router_control", None)
    if control is None:
        control = RouterControl(model)
        model._relax_router_control = control
    return control


def stack_recorded(control: RouterControl, batch: int, width: int) -> torch.Tensor:
    """The routes `control` recorded over one forward of `batch` x `width` tokens: [batch, width, L, k] long (and
    clears them)."""
    layers = []
    for rec in control.recorded:
        if len(rec) != 1:
            raise RuntimeError(f"expected one routing per MoE layer in a forward, got {len(rec)}")
        layers.append(rec[0].reshape(batch, width, control.top_k))
    control.recorded = [[] for _ in control.routers]
    return torch.stack(layers, dim=2)



def check_moe_checkpoint(cfg: Any, path: Any) -> None:
    """MoE options (rollout.routing_replay, rollout.record_routes, train.moe_aux_loss_coef, train.moe_z_loss_coef,
    train.moe_expert_bias_update_rate) against a model read from files, before anything starts: ValueError naming
    them and the model's type when its config is not of a registered router family (`relax.models.moe_families`), or
    the bias update's when its routers have no selection bias. `cfg`: the RelaxConfig; `path`: the model's directory
    (or .gguf file)."""
    ro, t = cfg.rollout, cfg.train
    rate = t.moe_expert_bias_update_rate
    options = [name for name, on in (("rollout.routing_replay=true", ro.routing_replay),
                                     ("rollout.record_routes=true", ro.record_routes),
                                     (f"train.moe_aux_loss_coef={t.moe_aux_loss_coef}", t.moe_aux_loss_coef > 0),
                                     (f"train.moe_z_loss_coef={t.moe_z_loss_coef}", t.moe_z_loss_coef > 0),
                                     (f"train.moe_expert_bias_update_rate={rate}", rate > 0))
               if on]
    if not options:
        return
    from transformers import AutoConfig

    if cfg.model.source == "gguf":
        config = gguf_config(path)
    else:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    family = family_of_model_type(config.model_type)
    if family is None:
        raise ValueError(f"{', '.join(options)}: the model at {str(path)!r} is {config.model_type!r}, not a "
                         f"mixture-of-experts model of a supported router family ({', '.join(ROUTED_MODEL_TYPES)})")
    if rate > 0 and family.selection_bias is None:
        raise ValueError(f"train.moe_expert_bias_update_rate={rate}: the model at {str(path)!r} is "
                         f"{config.model_type!r}, whose routers choose by their scores alone (no selection bias to "
                         f"update; auxiliary-loss-free load balancing: {', '.join(SELECTION_BIAS_MODEL_TYPES)})")
    routes = ro.routing_replay or ro.record_routes
    if routes and ro.backend == "sglang" and dense_among_sparse(config):  # the engines' start would refuse it
        why = dense_among_sparse_message(config.model_type, str(path))
        raise ValueError(f"{options[0]} with rollout=sglang: {why}")
