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
    finish_reason: list[str]  # "stop" | "length" per response ("abort": interrupted, to be continued)
    weight_version: int = 0
    engine_time: float = 0.0  # seconds the rollout engine(s) spent generating these (0: not measured)
    # mean probability mass top-k/top-p removed per drawn token (relax.backends.sampling); NaN: not reported
    dropped_mass: float = 0.0
    # [N] long: which sample each row is (prompt draw index * group size + index in the group); it keys the
    # sample's random stream (relax.backends.sampling.counter_uniforms). None: not tracked.
    sample_id: Optional[torch.Tensor] = None
    # [N, T] long: the weight version that generated each response token (0 where masked). With partial
    # rollout a response can span versions; otherwise every token of a row has the same one. None: all
    # tokens are `weight_version`.
    token_version: Optional[torch.Tensor] = None
    # [N, T] fp32: the trainer's log-prob of each token under the weights that generated it, where already computed
    # (NaN: not yet). Kept with samples a checkpoint carries across a resume, whose older weights the resumed
    # trainer no longer has. None: nothing computed.
    saved_old_logp: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def versions(self) -> torch.Tensor:
        """[N, T] long: the weight version of every response token (`token_version`, else `weight_version`)."""
        if self.token_version is not None:
            return self.token_version
        return torch.full(self.response_ids.shape, self.weight_version, dtype=torch.long)

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
    ids = [p.sample_id for p in parts]
    saved = None
    if any(p.saved_old_logp is not None for p in parts):
        saved = torch.cat([_pad_to(_unknown_if_none(p), T, float("nan"), False) for p in parts])
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
        sample_id=None if any(i is None for i in ids) else torch.cat(ids),
        token_version=torch.cat([_pad_to(p.versions() * p.response_mask, T, 0, False) for p in parts]),
        saved_old_logp=saved,
    )


def _unknown_if_none(samples: Samples) -> torch.Tensor:
    if samples.saved_old_logp is not None:
        return samples.saved_old_logp
    return torch.full(samples.response_ids.shape, float("nan"))


@dataclass
class Continuation:
    """What an engine needs to continue interrupted responses: one prompt per row (the original prompt followed by
    the response so far), the row's sample id, the response position it continues at and its remaining budget."""

    prompts: list[list[int]]
    sample_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] tokens already generated
    budgets: torch.Tensor  # [N] tokens still allowed (max_response_len - positions)


def continuation(partial: Samples, max_response_len: int) -> Continuation:
    """The `Continuation` of `partial`'s rows (each with at least one token to go)."""
    if partial.sample_id is None:
        raise ValueError("continuation: the interrupted samples carry no sample_id")
    done = partial.response_mask.sum(1)
    if bool((done >= max_response_len).any()):
        raise ValueError("continuation: a row already has max_response_len tokens")
    prompts = [p[pm.bool()].tolist() + r[rm.bool()].tolist() for p, pm, r, rm in
               zip(partial.prompt_ids, partial.prompt_mask, partial.response_ids, partial.response_mask, strict=True)]
    return Continuation(prompts, partial.sample_id.clone(), done.clone(), max_response_len - done)


def extend_responses(prefix: Samples, continuation: Samples, pad_token_id: int = 0) -> Samples:
    """`prefix` rows (interrupted responses) followed by `continuation` (the same rows, generated from prompt +
    prefix): one response per row, its tokens, log-probs and versions those of whichever part produced them."""
    if len(prefix) != len(continuation):
        raise ValueError(f"extend_responses: {len(prefix)} prefix rows but {len(continuation)} continuations")
    a, b = prefix.response_mask.sum(1), continuation.response_mask.sum(1)
    T = int((a + b).max()) if len(prefix) else 0
    ids = torch.full((len(prefix), T), pad_token_id, dtype=torch.long)
    logp = torch.zeros(len(prefix), T, dtype=torch.float32)
    version = torch.zeros(len(prefix), T, dtype=torch.long)
    pv, cv = prefix.versions(), continuation.versions()
    saved = None if prefix.saved_old_logp is None else torch.full((len(prefix), T), float("nan"))
    for i, (n, m) in enumerate(zip(a.tolist(), b.tolist(), strict=True)):
        if saved is not None:
            saved[i, :n] = prefix.saved_old_logp[i, :n]
        ids[i, :n], ids[i, n:n + m] = prefix.response_ids[i, :n], continuation.response_ids[i, :m]
        logp[i, :n], logp[i, n:n + m] = prefix.rollout_logp[i, :n], continuation.rollout_logp[i, :m]
        version[i, :n], version[i, n:n + m] = pv[i, :n], cv[i, :m]
    mask = (torch.arange(T)[None, :] < (a + b)[:, None]).long()
    tokens = float(mask.sum())
    return replace(
        prefix,
        response_ids=ids,
        response_mask=mask,
        rollout_logp=logp,
        finish_reason=list(continuation.finish_reason),
        weight_version=min(prefix.weight_version, continuation.weight_version),
        engine_time=prefix.engine_time + continuation.engine_time,
        dropped_mass=(prefix.dropped_mass * float(a.sum()) + continuation.dropped_mass * float(b.sum()))
        / max(1.0, tokens),
        token_version=version,
        saved_old_logp=saved,
    )
