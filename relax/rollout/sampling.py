"""Token sampling for the embedded rollout engine: temperature, top-k, top-p, and the log-prob we report.

Reported log-prob: log-softmax(logits / temperature) over the FULL vocabulary at the sampled token,
before any top-k/top-p truncation (temperature 0 reports temperature 1). The trainer, the reference and
the old-policy recomputation use exactly this distribution (`relax.models.hf.response_logprobs_all`
with the rollout temperature), so on-policy ratios are 1 and truncated importance sampling compares like
with like.

Top-k/top-p: the sampler draws from the truncated, renormalised distribution, but the log-probs on both
sides stay full-vocabulary (the choice verl and slime make; renormalising in the trainer would need the
same sort over the vocabulary at every position of every training forward). The gap is measured, not
hidden: `Sampled.dropped_mass` is the probability mass the truncation removed at each drawn token, logged
as `rollout/sampling_dropped_mass` (0 without truncation). When it is large, the rollout policy differs
from the policy the loss assumes; lower it with a larger top_p / top_k.

Constrained decoding (`relax.rollout.grammar`): the engine sets the tokens a row's grammar disallows to -inf before
`sample_tokens`, so the distribution drawn from and reported (the log-prob above) is the masked one, renormalised
over the allowed tokens; the trainer's recomputation does not apply the grammar, so such rows' ratios differ from 1.

Non-finite logits: a row whose logits hold a NaN or +inf (or are all -inf) has no distribution to draw from, and
drawing anyway would return arbitrary tokens with NaN log-probs that train as if real. `sample_tokens` raises
`NonFiniteLogitsError` instead, naming the cause (the weights, since every row of every batch goes through the
same weights, and the trainers never apply a non-finite step): the run stops rather than learn from garbage.
The check costs one max-reduction over the log-probs per drawn token.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class NonFiniteLogitsError(FloatingPointError):
    """The model produced logits with NaN or +inf (or only -inf) for some row: its weights are broken."""


class Sampled(NamedTuple):
    tokens: torch.Tensor  # [B] drawn token ids
    logp: torch.Tensor  # [B] full-vocabulary log-prob at the temperature (see the module docstring)
    dropped_mass: torch.Tensor  # [B] probability mass removed by top-k/top-p at this step (0 without them)


def filter_logits(logits: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """`logits` [B, V] with tokens outside the top-k / nucleus set to -inf (the most likely token always kept)."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens more likely than it already cover top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def counter_uniforms(seed: int, sample_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1] per row, a pure function of (seed, sample id, response position).

    The per-sample random streams of the rollout: a sample draws the same numbers whatever batch it is in,
    whichever engine replica runs it, and when it continues after an interruption (partial rollout) or a
    resume. float32 values with 24 random bits (exact in float32).
    """
    ids = sample_ids.detach().cpu().numpy().astype(np.uint64)
    pos = positions.detach().cpu().numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * _GOLDEN + _mix(ids))
        bits = _mix(key + (pos + np.uint64(1)) * _GOLDEN) >> np.uint64(40)
    return torch.from_numpy((bits + np.uint64(1)).astype(np.float32) * np.float32(2.0**-24))


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [B, V] by inverse CDF, given one uniform in (0, 1] per row (`uniforms` [B]).

    Same distribution as `torch.multinomial(probs, 1)`, which draws V exponentials per row and costs
    far more for a large vocabulary. A uniform of exactly 1 picks the last token of positive probability.
    """
    cdf = probs.cumsum(-1)
    u = uniforms.to(device=probs.device, dtype=cdf.dtype)[:, None]
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1)  # u > 0: never a p=0 token
    return tokens.clamp_(max=probs.shape[-1] - 1)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    uniforms: torch.Tensor,
) -> Sampled:
    """Tokens drawn from `logits` [B, V] (any dtype; the math runs in fp32) with one uniform per row
    (`uniforms` [B], see `counter_uniforms`; unused when greedy), with their log-probs.

    Raises `NonFiniteLogitsError` when a row's logits hold a NaN or +inf or are all -inf (module docstring)."""
    logits = logits.float()
    dropped = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    if temperature != 0.0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, -1)
    bad = torch.isnan(logp_all.amax(-1))  # NaN or +inf logits, or all -inf, make the whole row NaN
    if bool(bad.any()):
        raise NonFiniteLogitsError(
            f"the policy's logits are not finite (NaN, +inf or all -inf) in {int(bad.sum())} of {len(bad)} rows: "
            "its weights are broken (e.g. a diverged update: lower train.lr); refusing to sample from them")
    if temperature == 0.0:
        tokens = logits.argmax(-1)
    else:
        if top_k > 0 or top_p < 1.0:
            kept = filter_logits(logits, top_k, top_p)
            probs = kept.softmax(-1)
            dropped = (1.0 - torch.logsumexp(kept, -1).sub(torch.logsumexp(logits, -1)).exp()).clamp(min=0.0)
        else:
            probs = logp_all.exp()
        tokens = draw(probs, uniforms)
    return Sampled(tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1), dropped)
