"""Mixture-of-experts models in the torch trainer: rollout routing replay, router agreement, the load-balancing loss,
the router z-loss and the expert load (docs/training.md, "Mixture of experts").

A micro-batch reaches the model trimmed or packed (`relax.train.packing`); its routers see its tokens flattened in
that layout. `layout_index` runs the very same layout functions over the flat position of every token in
`Samples.sequences()`, so the engine's routes (`Samples.routed_experts`, [N, P+T, L, k]) line up with the tokens
the routers see whatever the layout (`routes_in_layout`). `TrainerRouting.micro_batch` arms the model's routers
(`relax.models.moe.RouterControl`) for one forward: compare with the engine's routes (`rollout/router_agreement`,
`rollout/router_own_agreement`), force them (`replay`), keep the logits and experts used of a training forward for
the load-balancing loss (`train.moe_aux_loss_coef`), the router z-loss (`train.moe_z_loss_coef`) and the expert-load
metrics (`train/moe_expert_load_*`, `train/moe_z_loss`: measured whatever the coefficients). After an applied
optimizer step, `update_selection_bias` moves a DeepSeek-V3 / GLM-4.5 router's selection bias by the step's expert
loads (auxiliary-loss-free load balancing, `train.moe_expert_bias_update_rate`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Optional

import torch

from relax.batch import Samples
from relax.config.schema import TrainConfig
from relax.metrics import (
    MOE_AUX_LOSS,
    MOE_EXPERT_BIAS_MAX,
    MOE_EXPERT_BIAS_MIN,
    MOE_Z_LOSS,
    ROUTER_AGREEMENT,
    ROUTER_OWN_AGREEMENT,
)
from relax.models.moe import (
    expert_counts,
    expert_load_metrics,
    is_moe,
    load_balancing_loss,
    router_control,
    z_loss_sum,
)
from relax.models.moe_families import ROUTED_MODEL_TYPES, SELECTION_BIAS_MODEL_TYPES
from relax.train.packing import pack, trimmed_sequences


def layout_index(mb: Samples, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [M], real [M] bool) of the M tokens the model computes for micro-batch `mb` laid out as the trainer
    lays it out (`pack` when `packed`, else `trimmed_sequences`): each token's flat position row * (P+T) + column in
    `mb.sequences()`, and whether it is a real token (not padding)."""
    N, P = mb.prompt_ids.shape
    T = mb.response_ids.shape[1]
    flat = torch.arange(N * (P + T)).view(N, P + T)
    positions = replace(mb, prompt_ids=flat[:, :P], response_ids=flat[:, P:])
    if packed:
        ids = pack(positions).input_ids.reshape(-1)
        return ids, torch.ones_like(ids, dtype=torch.bool)
    ids, mask, _, _ = trimmed_sequences(positions)
    return ids.reshape(-1), mask.reshape(-1) != 0


def routes_in_layout(mb: Samples, packed: bool) -> torch.Tensor:
    """[M, L, k] long: the engine's experts of each token the model computes for `mb` (-1 at padding and where none
    was recorded)."""
    routes = mb.routed_experts
    index, real = layout_index(mb, packed)
    out = routes.reshape(-1, *routes.shape[2:])[index].long()
    if routes.dtype == torch.uint8:
        out[out == 255] = -1
    out[~real] = -1
    return out


def routed_tokens(samples: Samples) -> int:
    """Tokens of `samples` the routers route in a forward, whatever the layout: every real prompt and response token
    (observations included), padding excluded (`Samples.sequences`' attention mask). The router z-loss of a step is
    its mean over these, so each micro-batch's share is its own sum divided by the step's count."""
    return int((samples.sequences()[1] != 0).sum())


class TrainerRouting:
    """What the trainer does with a mixture-of-experts policy's routers (None of it for a dense model: `for_model`).
    `replay`: force the engine's routes in every log-prob forward; `aux_coef`: the load-balancing loss's
    coefficient (0: not computed); `z_coef`: the router z-loss's (0: measured, not trained on); `bias_rate`: the
    selection bias's update rate (0: the bias stays as loaded). Every training forward (one with a gradient) counts
    the experts each real token used in each layer, for the expert-load metrics and the bias update."""

    def __init__(self, model: torch.nn.Module, *, replay: bool, aux_coef: float, z_coef: float = 0.0,
                 bias_rate: float = 0.0) -> None:
        self.control = router_control(model)
        self.replay = replay
        self.aux_coef = float(aux_coef)
        self.z_coef = float(z_coef)
        self.bias_rate = float(bias_rate)
        if self.bias_rate < 0:
            raise ValueError(f"train.moe_expert_bias_update_rate={bias_rate} must be >= 0")
        if self.bias_rate > 0 and self.control.family.selection_bias is None:
            raise ValueError(f"train.moe_expert_bias_update_rate={bias_rate}: {type(model).__name__}'s routers "
                             f"({self.control.family.name}) choose by their scores alone, there is no selection bias "
                             f"to update (auxiliary-loss-free load balancing: {', '.join(SELECTION_BIAS_MODEL_TYPES)})")
        # the expert loads [MoE layers, E] of the last step's training forwards, kept by `metrics` for the update
        self._step_counts: Optional[torch.Tensor] = None
        self._aux: list[tuple[float, float]] = []  # (aux loss, tokens) of each training micro-batch
        self._z = 0.0  # the step's z-loss so far: its micro-batches' sums over layers and tokens / (layers * tokens)
        self._counts = torch.zeros(self.control.num_layers, self.control.num_experts, dtype=torch.float64)
        self._trained = False  # a training forward ran since the last `metrics`
        self._real: Optional[torch.Tensor] = None

    @staticmethod
    def for_model(model: torch.nn.Module, train_cfg: TrainConfig, *, replay: bool) -> Optional[TrainerRouting]:
        if not is_moe(model):
            options = [name for name, on in (("rollout.routing_replay", replay),
                                             ("train.moe_aux_loss_coef", train_cfg.moe_aux_loss_coef > 0),
                                             ("train.moe_z_loss_coef", train_cfg.moe_z_loss_coef > 0),
                                             ("train.moe_expert_bias_update_rate",
                                              train_cfg.moe_expert_bias_update_rate > 0)) if on]
            if options:
                raise ValueError(f"{' and '.join(options)} need{'s' if len(options) == 1 else ''} a "
                                 f"mixture-of-experts model of a supported router family ({type(model).__name__} "
                                 f"has no MoE router of {', '.join(ROUTED_MODEL_TYPES)})")
            return None
        return TrainerRouting(model, replay=replay, aux_coef=train_cfg.moe_aux_loss_coef,
                              z_coef=train_cfg.moe_z_loss_coef, bias_rate=train_cfg.moe_expert_bias_update_rate)

    @contextmanager
    def micro_batch(self, mb: Samples, packed: bool) -> Iterator[None]:
        """One forward over `mb`: compared with (and, replaying, routed as) the engine where `mb` carries routes;
        with a gradient (a training forward), its router logits and experts used kept for `loss_terms`."""
        engine = routes_in_layout(mb, packed) if mb.routed_experts is not None else None
        collect = torch.is_grad_enabled()
        self.control.arm(engine, force=self.replay, collect=collect)
        self._real = layout_index(mb, packed)[1] if collect else None
        try:
            yield
        finally:
            self.control.disarm()

    def loss_terms(self, weight: float, step_tokens: int) -> Optional[torch.Tensor]:
        """After the training forward of a micro-batch under `micro_batch`: counts the experts its real tokens used
        in each layer, and returns its share of the MoE loss terms (None when neither is on): coef * weight * the
        load-balancing loss (mean over MoE layers; `weight`: the micro-batch's share of the step's rows, so that the
        step's sum is the rows' mean) + z_coef * its z-loss sum / (MoE layers * `step_tokens`: the step's
        `routed_tokens`), so that the step's sum is the z-loss's mean over its tokens and layers. The trainer adds it
        to the micro-batch's loss and to `train/loss` (`StepLoss.add_loss`)."""
        c = self.control
        if c.logits[0] is None:
            return None
        real = self._real.to(c.logits[0].device)
        self._trained = True
        terms: list[torch.Tensor] = []
        for layer, used in enumerate(c.used):
            self._counts[layer] += expert_counts(used.detach(), real, c.num_experts)
        with torch.enable_grad() if self.z_coef > 0 else torch.no_grad():  # measured either way
            z = torch.stack([z_loss_sum(logits, real) for logits in c.logits]).sum()
            z = z / (c.num_layers * max(1, step_tokens))
        self._z += float(z.detach())
        if self.z_coef > 0:
            terms.append(self.z_coef * z)
        if self.aux_coef > 0:
            losses = [load_balancing_loss(logits, used, real, c.num_experts, c.top_k, c.family.aux_scores)
                      for logits, used in zip(c.logits, c.used, strict=True)]
            loss = torch.stack(losses).mean()
            self._aux.append((float(loss.detach()), float(weight)))
            terms.append(self.aux_coef * weight * loss)
        c.logits = [None] * c.num_layers
        c.used = [None] * c.num_layers
        return sum(terms[1:], terms[0]) if terms else None

    def metrics(self) -> dict[str, float]:
        """The router agreement since the last call (token-layers with a recorded route whose experts the trainer
        used / would choose itself equal the engine's); of the training forwards since: the expert load
        (`expert_load_metrics`), the router z-loss (the step's mean over tokens and layers) and the load-balancing
        loss (the step's mean over rows)."""
        out: dict[str, float] = {}
        compared, used, own = self.control.take_counts().tolist()
        if compared > 0:
            out[ROUTER_AGREEMENT] = used / compared
            out[ROUTER_OWN_AGREEMENT] = own / compared
        if self._trained:
            out |= expert_load_metrics(self._counts)
            out[MOE_Z_LOSS] = self._z
            self._step_counts = self._counts.clone()
        self._counts.zero_()
        self._z, self._trained = 0.0, False
        if self._aux:
            total = sum(w for _, w in self._aux)
            out[MOE_AUX_LOSS] = sum(v * w for v, w in self._aux) / total if total > 0 else 0.0
            self._aux = []
        return out

    def selection_biases(self) -> list[torch.Tensor]:
        """Each MoE layer's selection bias buffer (the live tensors; empty for a family without one)."""
        name = self.control.family.selection_bias
        return [] if name is None else [getattr(router, name) for router in self.control.routers]

    def selection_bias_names(self, model: torch.nn.Module) -> list[str]:
        """The `model.state_dict()` names of those buffers."""
        name = self.control.family.selection_bias
        if name is None:
            return []
        routers = {id(r) for r in self.control.routers}
        return [f"{path}.{name}" for path, module in model.named_modules() if id(module) in routers]

    @torch.no_grad()
    def update_selection_bias(self, applied: bool) -> dict[str, float]:
        """Auxiliary-loss-free load balancing after an optimizer step (DeepSeek-V3, section 2.1.2; megatron-core's
        `get_updated_expert_bias`): each MoE layer l's selection bias b_l += rate * sign(mean_e c_{l,e} - c_{l,e}),
        c the tokens each expert got in the step's training forwards (the experts used: the engine's under replay,
        where the choice is forced and the bias decides nothing in the trainer; real tokens only, summed over the
        micro-batches: `metrics` keeps them), in fp32. Not `applied` (a skipped, non-finite step): nothing changes,
        as with the weights. Returns the bias's max and min over layers and experts after the update ({} when the
        rate is 0 or no training forward counted a token)."""
        counts, self._step_counts = self._step_counts, None
        if self.bias_rate <= 0 or counts is None or not applied:
            return {}
        biases = self.selection_biases()
        for layer, bias in enumerate(biases):
            c = counts[layer]
            step = torch.sign(c.mean() - c).to(device=bias.device, dtype=torch.float32)
            bias.copy_(bias.float() + step * self.bias_rate)
        flat = torch.cat([b.detach().float().reshape(-1).cpu() for b in biases])
        return {MOE_EXPERT_BIAS_MAX: float(flat.max()), MOE_EXPERT_BIAS_MIN: float(flat.min())}
