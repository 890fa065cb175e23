"""Token sampling for the embedded rollout engine: temperature, top-k, top-p, and the log-prob we report.

Reported log-prob: log-softmax(logits / temperature) over the FULL vocabulary at the sampled token,
before any top-k/top-p truncation (temperature 0 reports temperature 1). With temperature 1 this is
exactly what the trainer computes for the same token, so truncated importance sampling compares like
with like; truncation only changes which tokens get drawn.
"""

from __future__ import annotations

import torch


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


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [B, V] by inverse CDF: one uniform per row.

    Same distribution as `torch.multinomial(probs, 1)`, which draws V exponentials per row and costs
    ~25x more here (37 ms vs 1.6 ms for [32, 49152] on a CPU core).
    """
    cdf = probs.cumsum(-1)
    u = 1.0 - torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)  # (0, 1]: never a p=0 token
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], log-probs [B]) drawn from `logits` [B, V] (any dtype; the math runs in fp32)."""
    logits = logits.float()
    if temperature == 0.0:
        tokens = logits.argmax(-1)
        logp_all = torch.log_softmax(logits, -1)
    else:
        if temperature != 1.0:
            logits = logits / temperature
        logp_all = torch.log_softmax(logits, -1)
        if top_k > 0 or top_p < 1.0:
            probs = filter_logits(logits, top_k, top_p).softmax(-1)
        else:
            probs = logp_all.exp()
        tokens = draw(probs, generator)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)
