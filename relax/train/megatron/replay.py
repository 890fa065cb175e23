"""Rollout routing replay and router agreement on the Megatron backend, through megatron-core's `RouterReplay`
(docs/training.md, "Mixture of experts").

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
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from relax.metrics import ROUTER_AGREEMENT, ROUTER_OWN_AGREEMENT


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
        # token-layers compared with a recorded route, whose used experts equal it, whose own choice does
        self.counts = torch.zeros(3, dtype=torch.float64)
        for i, router in enumerate(self.routers):
            rr = router.router_replay
            if rr in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(rr)
            rr.get_replay_topk = self._wrap(i, rr)

    def _wrap(self, layer: int, rr: Any):
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        original = RouterReplay.get_replay_topk.__get__(rr)

        def get_replay_topk(scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                            group_topk: Optional[int] = None, default_compute_topk: Any = None):
            probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target = self._targets[layer]
            if target is None:
                return probs, own
            target = target.to(own.device)
            if target.shape != own.shape:
                raise ValueError(f"MoE layer {self.layer_offset + layer}: routes of shape {tuple(target.shape)} for "
                                 f"{tuple(own.shape)} routed tokens")
            known = ((target >= 0) & (target < self.num_experts)).all(-1)
            used = torch.where(known[:, None], target, own) if self.replay else own
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
        if routes is None:
            self.disarm()
            return
        for i in range(len(self.routers)):
            per_layer = routes[:, :, self.layer_offset + i]  # [B, L, k]
            self._targets[i] = per_layer.transpose(0, 1).reshape(-1, per_layer.shape[-1])

    def disarm(self) -> None:
        self._targets = [None] * len(self.routers)

    def metrics(self, group: Any = None, device: Optional[torch.device] = None) -> dict[str, float]:
        """The router agreement since the last call, summed over `group` (a collective on its ranks, tensors on
        `device`: NCCL's on the GPU; the caller's group holds each token's router once)."""
        counts, self.counts = self.counts, torch.zeros(3, dtype=torch.float64)
        if torch.distributed.is_initialized():
            counts = counts.to(device or "cpu")
            torch.distributed.all_reduce(counts, group=group)
        compared, used, own = counts.cpu().tolist()
        if compared <= 0:
            return {}
        return {ROUTER_AGREEMENT: used / compared, ROUTER_OWN_AGREEMENT: own / compared}
