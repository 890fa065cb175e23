"""Rollout routing replay, router agreement, the expert load, the router z-loss and the load-balancing loss on the
Megatron backend, through megatron-core's `RouterReplay` and its router's z-loss (docs/training.md, "Mixture of
experts").

An MoE model built with `moe_enable_routing_replay=True` gives each `TopKRouter` a `RouterReplay`, which its top-k
selection consults (`topk_routing_with_score_function(..., router_replay=...)`). `MegatronRouting` takes those of one
model (out of megatron-core's process-wide list, so that several models in a process stay apart) and wraps each
one's `get_replay_topk`: for the forward of a micro-batch armed with the engine's routes (`arm`) it computes the
router's own top-k, counts how often it (and the experts used) equal the engine's, and, replaying, hands the
engine's experts to megatron-core's own `REPLAY_FORWARD` path (`set_target_indices`), which gathers the router's
scores at them: the weights come from this model's router (p[forced], renormalised under `norm_topk_prob`), as the
torch backend's `relax.models.moe.RouterControl` does. A token without a recorded route (padding, a token the engine
never fed) keeps the router's own choice.

Token order: megatron-core's hidden states are [sequence, batch, hidden] and a router flattens them sequence-major,
so the routes of a micro-batch [B, L, layers, k] go to layer l as routes[:, :, l].transpose(0, 1) -> [L * B, k].

Expert load: in a training forward (`count_tokens`: the micro-batch's real tokens), the same wrapper counts the experts
each real token used in each layer (the replayed ones under replay), as the torch backend's
`relax.train.routing.TrainerRouting` does; `metrics` sums them over the data-parallel ranks before any ratio.

Router z-loss: megatron-core's own (`TopKRouter.apply_z_loss`, fed the model's `padding_mask` so that padding is left
out) with a coefficient the trainer sets for each step (`z_loss_coeff`); each router's `apply_z_loss` is wrapped to
measure the value too (`z_sum`), in the forward that carries the gradient (the recomputed one under activation
recompute).

Load-balancing loss (train.moe_aux_loss_coef): the torch backend's definition (`relax.models.moe.load_balancing_loss`,
the one owner of the formula), not megatron-core's aux loss, which counts the router's own top-k even when the routes
are replayed (`compute_routing_scores_for_aux_loss`) where the torch backend counts the experts used, and scales by the
micro-batch's tokens under calculate_per_token_loss. Each router's `routing` is wrapped: in the forward that carries
the gradient of a training pass, the loss of its layer over the micro-batch's real tokens (megatron-core's
`padding_mask` left out) from the router's logits and the experts it used (its routing map: the engine's under
replay), times the micro-batch's share of the step's rows (`aux_share`) and the coefficient over the MoE layers, is
attached to the router's probabilities by megatron-core's `MoEAuxLossAutoScaler` (so that it reaches the backward of a
recomputed layer too, with the main loss's scale); its value is summed in `aux_sum`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from relax.metrics import ROUTER_AGREEMENT, ROUTER_OWN_AGREEMENT
from relax.models.moe import expert_counts, expert_load_metrics, load_balancing_loss, z_loss_sum


class MegatronRouting:
    """The routers of one pipeline stage's model (in layer order, `layer_offset` the first one's global index)."""

    def __init__(self, module: torch.nn.Module, *, replay: bool, num_experts: int, layer_offset: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
        if not self.routers or any(r.router_replay is None for r in self.routers):
            raise ValueError("MegatronRouting needs an MoE model built with moe_enable_routing_replay=True")
        self.replay = replay
        self.num_experts = int(num_experts)
        self.layer_offset = int(layer_offset)
        self._targets: list[Optional[torch.Tensor]] = [None] * len(self.routers)
        self._real: Optional[torch.Tensor] = None  # [L * B] bool: the real tokens of an armed training forward
        # token-layers compared with a recorded route, whose used experts equal it, whose own choice does
        self.counts = torch.zeros(3, dtype=torch.float64)
        # each layer's tokens routed to each expert in the training forwards since `metrics`
        self.load = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64)
        self.trained = False  # a training forward counted since `metrics`
        # the training pass of a step (`accumulate_gradients`): the z-loss of its forwards with a gradient is measured
        self.training_pass = False
        self.z_sum = 0.0  # sum over this stage's layers and real tokens of logsumexp(logits)^2, this training pass
        # the load-balancing loss of a training pass: train.moe_aux_loss_coef (0: off), the micro-batch's share of the
        # step's rows, and the sum over this rank's micro-batches of share * (mean over the MoE layers of the loss)
        self.aux_coef = 0.0
        self.aux_share = 0.0
        self.aux_sum = 0.0
        for i, router in enumerate(self.routers):
            rr = router.router_replay
            if rr in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(rr)
            rr.get_replay_topk = self._wrap(i, rr)
            router.apply_z_loss = self._wrap_z(router)
            router.routing = self._wrap_routing(router)

    def z_loss_coeff(self, coeff: Optional[float]) -> None:
        """megatron-core's per-layer z-loss coefficient of the next forwards (None: off), on the config the routers
        share: the trainer sets train.moe_z_loss_coef / (MoE layers * the step's routed tokens) for a step's training
        pass, since megatron-core scales each micro-batch's z-loss by its own tokens (calculate_per_token_loss) and
        Relax's finalize_model_grads does not divide by the step's."""
        for router in self.routers:
            router.config.moe_z_loss_coeff = coeff

    def _wrap_z(self, router: torch.nn.Module):
        original = router.apply_z_loss

        def apply_z_loss(logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
            # as megatron-core's: only in a forward that builds the gradient (the recomputed one under recompute)
            if self.training_pass and router.training and torch.is_grad_enabled():
                with torch.no_grad():
                    self.z_sum += float(z_loss_sum(logits, None if padding_mask is None else ~padding_mask))
            return original(logits, padding_mask=padding_mask)

        return apply_z_loss

    def _wrap_routing(self, router: torch.nn.Module):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        original = router.routing
        top_k = int(router.topk)

        def routing(logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
            probs, routing_map = original(logits, padding_mask=padding_mask)
            # as megatron-core's aux loss: only in a forward that builds the gradient (the recomputed one under
            # recompute), so that each micro-batch counts once
            if self.aux_coef > 0 and self.training_pass and router.training and torch.is_grad_enabled():
                flat = logits.reshape(-1, self.num_experts)
                # no token dropping: every token has exactly top_k experts in its routing map, in expert order
                used = routing_map.nonzero()[:, 1].view(flat.shape[0], top_k)
                real = None if padding_mask is None else ~padding_mask.reshape(-1)
                # MoE trains at pipeline parallel size 1: this stage's routers are all of the model's MoE layers
                loss = load_balancing_loss(flat, used, real, self.num_experts, top_k) / len(self.routers)
                self.aux_sum += self.aux_share * float(loss.detach())
                probs = MoEAuxLossAutoScaler.apply(probs, (self.aux_coef * self.aux_share) * loss)
            return probs, routing_map

        return routing

    def _count(self, layer: int, used: torch.Tensor) -> None:
        if self._real is not None:
            real = self._real.to(used.device)
            if real.shape[0] != used.shape[0]:
                raise ValueError(f"MoE layer {self.layer_offset + layer}: {real.shape[0]} token flags for "
                                 f"{used.shape[0]} routed tokens")
            self.load[layer] += expert_counts(used.detach(), real, self.num_experts)
            self.trained = True

    def _wrap(self, layer: int, rr: Any):
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        original = RouterReplay.get_replay_topk.__get__(rr)

        def get_replay_topk(scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                            group_topk: Optional[int] = None, default_compute_topk: Any = None):
            probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target = self._targets[layer]
            if target is None:
                self._count(layer, own)
                return probs, own
            target = target.to(own.device)
            if target.shape != own.shape:
                raise ValueError(f"MoE layer {self.layer_offset + layer}: routes of shape {tuple(target.shape)} for "
                                 f"{tuple(own.shape)} routed tokens")
            known = ((target >= 0) & (target < self.num_experts)).all(-1)
            used = torch.where(known[:, None], target, own) if self.replay else own
            self._count(layer, used)
            with torch.no_grad():
                want = target[known].sort(-1).values
                self.counts += torch.tensor([float(known.sum()),
                                             float((used[known].sort(-1).values == want).all(-1).sum()),
                                             float((own[known].sort(-1).values == want).all(-1).sum())],
                                            dtype=torch.float64)
            if not self.replay:
                return probs, own
            rr.set_target_indices(used)
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            try:
                return original(scores, topk, num_groups, group_topk, default_compute_topk)
            finally:
                rr.clear_router_replay_action()
                rr.clear_indices()

        return get_replay_topk

    def arm(self, routes: Optional[torch.Tensor]) -> None:
        """The next forward's micro-batch carries the engine's routes [B, L, layers, k] (long, -1 where none was
        recorded; `layers` counts the whole model's MoE layers), or none (None: the routers route on their own)."""
        self.disarm()
        if routes is None:
            return
        for i in range(len(self.routers)):
            per_layer = routes[:, :, self.layer_offset + i]  # [B, L, k]
            self._targets[i] = per_layer.transpose(0, 1).reshape(-1, per_layer.shape[-1])

    def count_tokens(self, real: torch.Tensor) -> None:
        """The next forward (a training one, after `arm`) counts the experts of the tokens `real` [B, L] bool flags
        in the expert load (until `disarm`)."""
        self._real = real.transpose(0, 1).reshape(-1)

    def disarm(self) -> None:
        self._targets = [None] * len(self.routers)
        self._real = None

    def metrics(self, group: Any = None, device: Optional[torch.device] = None) -> dict[str, float]:
        """The router agreement and the expert load since the last call, summed over `group` (a collective on its
        ranks, tensors on `device`: NCCL's on the GPU; the caller's group holds each token's router once)."""
        counts, self.counts = self.counts, torch.zeros(3, dtype=torch.float64)
        load, self.load = self.load, torch.zeros_like(self.load)
        trained = torch.tensor([counts.tolist() + [float(self.trained)]], dtype=torch.float64)
        self.trained = False
        both = torch.cat([trained.flatten(), load.flatten()])
        if torch.distributed.is_initialized():
            both = both.to(device or "cpu")
            torch.distributed.all_reduce(both, group=group)
        both = both.cpu()
        (compared, used, own, trained_ranks), load = both[:4].tolist(), both[4:].view_as(load)
        out: dict[str, float] = {}
        if trained_ranks > 0:
            out |= expert_load_metrics(load)
        if compared > 0:
            out |= {ROUTER_AGREEMENT: used / compared, ROUTER_OWN_AGREEMENT: own / compared}
        return out
