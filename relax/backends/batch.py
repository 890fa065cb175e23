"""The tensors that move between roles. CPU tensors; every backend speaks these and nothing else.

Layout: prompts are LEFT-padded to a common width P and responses RIGHT-padded to a common width T,
so every response starts at column P of `sequences()`. Per-token tensors of the algorithms ([N, T])
are aligned with `response_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch


@dataclass
class Samples:
    """What a rollout returns: N responses, the responses of one prompt consecutive."""

    prompt_ids: torch.Tensor  # [N, P] long, left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    response_ids: torch.Tensor  # [N, T] long, right-padded
    response_mask: torch.Tensor  # [N, T] 1 on generated tokens (the stop token included)
    rollout_logp: torch.Tensor  # [N, T] log-prob of each sampled token under the rollout engine
    finish_reason: list[str]  # "stop" | "length" per response
    weight_version: int = 0
    engine_time: float = 0.0  # seconds the rollout engine(s) spent generating these (0: not measured)
    dropped_mass: float = 0.0  # mean probability mass top-k/top-p removed per drawn token (relax.backends.sampling)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [N, P+T], attention_mask [N, P+T]) of prompt followed by response."""
        ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)
        return ids, mask

    def select(self, index: torch.Tensor | slice) -> Samples:
        """Rows `index` of every tensor (a micro-batch, a shard)."""
        if isinstance(index, slice):
            rows = list(range(len(self)))[index]
        else:
            rows = index.tolist()
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value[index]
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in rows]
            else:
                out[f.name] = value
        return type(self)(**out)


@dataclass
class TrainBatch(Samples):
    """Samples plus what the algorithm computed for them; optional tensors are [N, T]."""

    rewards: Optional[torch.Tensor] = None  # [N]
    advantages: Optional[torch.Tensor] = None
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None  # PPO critic targets
    old_values: Optional[torch.Tensor] = None  # PPO critic values at rollout time
    extras: dict = field(default_factory=dict)

    @classmethod
    def from_samples(cls, samples: Samples, **tensors: Optional[torch.Tensor]) -> TrainBatch:
        base = {f.name: getattr(samples, f.name) for f in fields(Samples)}
        return cls(**base, **tensors)

    def with_(self, **changes) -> TrainBatch:
        return replace(self, **changes)


def _pad_to(x: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra == 0:
        return x
    pad = torch.full((x.shape[0], extra), value, dtype=x.dtype)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def concat_samples(parts: list[Samples], pad_token_id: int = 0) -> Samples:
    """Stack Samples of several engines, re-padding prompts (left) and responses (right) to common widths."""
    P = max(p.prompt_ids.shape[1] for p in parts)
    T = max(p.response_ids.shape[1] for p in parts)
    return Samples(
        prompt_ids=torch.cat([_pad_to(p.prompt_ids, P, pad_token_id, True) for p in parts]),
        prompt_mask=torch.cat([_pad_to(p.prompt_mask, P, 0, True) for p in parts]),
        response_ids=torch.cat([_pad_to(p.response_ids, T, pad_token_id, False) for p in parts]),
        response_mask=torch.cat([_pad_to(p.response_mask, T, 0, False) for p in parts]),
        rollout_logp=torch.cat([_pad_to(p.rollout_logp, T, 0.0, False) for p in parts]),
        finish_reason=[r for p in parts for r in p.finish_reason],
        weight_version=min(p.weight_version for p in parts),
        engine_time=max(p.engine_time for p in parts),  # engines run side by side
        dropped_mass=sum(p.dropped_mass * float(p.response_mask.sum()) for p in parts)
        / max(1.0, float(sum(p.response_mask.sum() for p in parts))),
    )
