"""What the fault tests share: a tiny model config and random train batches (a module: `conftest` names clash)."""

from __future__ import annotations

import torch

from relax.batch import Samples, TrainBatch
from relax.config.schema import ModelConfig

VOCAB = 32
PAD = 0
TINY = ModelConfig(name="tiny-test", source="config", dtype="float32", hidden_size=32, num_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                   max_position_embeddings=64)


def random_batch(n: int = 8, P: int = 5, T: int = 4, *, seed: int = 0) -> TrainBatch:
    """Left-padded prompts, right-padded responses (row 0 full), random per-response advantages and returns."""
    g = torch.Generator().manual_seed(seed)
    plen, rlen = torch.randint(1, P + 1, (n,), generator=g), torch.randint(1, T + 1, (n,), generator=g)
    plen[0], rlen[0] = P, T
    prompt_ids, prompt_mask = torch.full((n, P), PAD), torch.zeros(n, P, dtype=torch.long)
    response_ids, response_mask = torch.full((n, T), PAD), torch.zeros(n, T, dtype=torch.long)
    for i in range(n):
        p, r = int(plen[i]), int(rlen[i])
        prompt_ids[i, P - p:] = torch.randint(1, VOCAB, (p,), generator=g)
        prompt_mask[i, P - p:] = 1
        response_ids[i, :r] = torch.randint(1, VOCAB, (r,), generator=g)
        response_mask[i, :r] = 1
    samples = Samples(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                      response_mask=response_mask, rollout_logp=torch.zeros(n, T), finish_reason=["stop"] * n)
    advantages = torch.randn(n, 1, generator=g).expand(n, T) * response_mask
    returns = torch.rand(n, T, generator=g) * response_mask
    return TrainBatch.from_samples(samples, advantages=advantages, returns=returns)
