"""Mixture-of-experts models in the torch trainer: rollout routing replay, router agreement, the load-balancing loss
(docs/training.md, "Mixture of experts").

A micro-batch reaches the model trimmed or packed (`relax.train.packing`); its routers see its tokens flattened in
that layout. `layout_index` runs the very same layout functions over the flat position of every token in
`Samples.sequences()`, so the engine's routes (`Samples.routed_experts`, [N, P+T, L, k]) line up with the tokens
the routers see whatever the layout (`routes_in_layout`). `TrainerRouting.micro_batch` arms the model's routers
(`relax.models.moe.RouterControl`) for one forward: compare with the engine's routes (`rollout/router_agreement`,
`rollout/router_own_agreement`), force them (`replay`), keep the logits for the load-balancing loss
(`train.moe_aux_loss_coef`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Optional

import torch

from relax.batch import Samples
from relax.config.schema import TrainConfig
from relax.metrics import MOE_AUX_LOSS, ROUTER_AGREEMENT, ROUTER_OWN_AGREEMENT
from relax.models.moe import is_moe, load_balancing_loss, router_control
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


class TrainerRouting:
    """What the trainer does with a mixture-of-experts policy's routers (None of it for a dense model: `for_model`).
    `replay`: force the engine's routes in every log-prob forward; `aux_coef`: the load-balancing loss's
    coefficient (0: not computed)."""

    def __init__(self, model: torch.nn.Module, *, replay: bool, aux_coef: float) -> None:
        self.control = router_control(model)
        self.replay = replay
        self.aux_coef = float(aux_coef)
        self._aux: list[tuple[float, float]] = []  # (aux loss, tokens) of each training micro-batch

    @staticmethod
    def for_model(model: torch.nn.Module, train_cfg: TrainConfig, *, replay: bool) -> Optional[TrainerRouting]:
        if not is_moe(model):
            if replay or train_cfg.moe_aux_loss_coef > 0:
                raise ValueError("rollout.routing_replay and train.moe_aux_loss_coef need a mixture-of-experts model "
                                 f"({type(model).__name__} has no MoE router)")
            return None
        return TrainerRouting(model, replay=replay, aux_coef=train_cfg.moe_aux_loss_coef)

    @contextmanager
    def micro_batch(self, mb: Samples, packed: bool) -> Iterator[None]:
        """One forward over `mb`: compared with (and, replaying, routed as) the engine where `mb` carries routes;
        with a gradient and `aux_coef > 0`, its router logits kept for `aux_loss`."""
        engine = routes_in_layout(mb, packed) if mb.routed_experts is not None else None
        collect = self.aux_coef > 0 and torch.is_grad_enabled()
        self.control.arm(engine, force=self.replay, collect=collect)
        self._real = layout_index(mb, packed)[1] if collect else None
        try:
            yield
        finally:
            self.control.disarm()

    def aux_loss(self, weight: float) -> Optional[torch.Tensor]:
        """coef * weight * the load-balancing loss (mean over MoE layers) of the last forward under `micro_batch`
        (`weight`: the micro-batch's share of the step's rows, so that the step's sum is the rows' mean); None when
        not collected. The trainer adds it to the micro-batch's loss and to `train/loss` (`StepLoss.add_loss`)."""
        c = self.control
        if self.aux_coef <= 0 or c.logits[0] is None:
            return None
        real = self._real.to(c.logits[0].device)
        losses = [load_balancing_loss(z, used, real, c.num_experts, c.top_k)
                  for z, used in zip(c.logits, c.used, strict=True)]
        loss = torch.stack(losses).mean()
        self._aux.append((float(loss.detach()), float(weight)))
        c.logits = [None] * c.num_layers
        c.used = [None] * c.num_layers
        return self.aux_coef * weight * loss

    def metrics(self) -> dict[str, float]:
        """The router agreement since the last call (token-layers with a recorded route whose experts the trainer
        used / would choose itself equal the engine's), and the load-balancing loss (the step's mean over rows)."""
        out: dict[str, float] = {}
        compared, used, own = self.control.take_counts().tolist()
        if compared > 0:
            out[ROUTER_AGREEMENT] = used / compared
            out[ROUTER_OWN_AGREEMENT] = own / compared
        if self._aux:
            total = sum(w for _, w in self._aux)
            out[MOE_AUX_LOSS] = sum(v * w for v, w in self._aux) / total if total > 0 else 0.0
            self._aux = []
        return out
