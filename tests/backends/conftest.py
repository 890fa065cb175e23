"""Fixtures of the torch backend tests: a tiny Qwen3 config and random left/right-padded batches."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from relax.batch import Samples, TrainBatch
from relax.config.schema import ModelConfig, TrainConfig

VOCAB = 32
PAD = 0


@pytest.fixture
def tiny_model_cfg() -> ModelConfig:
    return ModelConfig(
        name="tiny-test",
        source="config",
        dtype="float32",
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=64,
    )


@pytest.fixture
def train_cfg() -> TrainConfig:
    return TrainConfig(lr=1e-3, clip_grad=0.0, num_rollout=10)


def random_samples(
    n: int = 6, P: int = 5, T: int = 4, *, seed: int = 0, vocab: int = VOCAB, full_row: bool = True
) -> Samples:
    """Prompts of 1..P real tokens (left-padded), responses of 1..T tokens (right-padded); pad id 0.

    With `full_row`, row 0 uses all P prompt and T response columns (so trimming keeps every column).
    """
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, P + 1, (n,), generator=g)
    rlen = torch.randint(1, T + 1, (n,), generator=g)
    if full_row:
        plen[0], rlen[0] = P, T
    prompt_ids = torch.full((n, P), PAD, dtype=torch.long)
    prompt_mask = torch.zeros(n, P, dtype=torch.long)
    response_ids = torch.full((n, T), PAD, dtype=torch.long)
    response_mask = torch.zeros(n, T, dtype=torch.long)
    for i in range(n):
        p, r = int(plen[i]), int(rlen[i])
        prompt_ids[i, P - p :] = torch.randint(1, vocab, (p,), generator=g)
        prompt_mask[i, P - p :] = 1
        response_ids[i, :r] = torch.randint(1, vocab, (r,), generator=g)
        response_mask[i, :r] = 1
    return Samples(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_logp=torch.zeros(n, T),
        finish_reason=["stop"] * n,
    )


def random_batch(n: int = 8, P: int = 5, T: int = 4, *, seed: int = 0, **tensors: torch.Tensor) -> TrainBatch:
    """A TrainBatch with random advantages (per response, broadcast over tokens) unless given."""
    s = random_samples(n, P, T, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    if "advantages" not in tensors:
        tensors["advantages"] = torch.randn(n, 1, generator=g).expand(n, T) * s.response_mask
    return TrainBatch.from_samples(s, **tensors)


@pytest.fixture
def make_samples() -> Callable[..., Samples]:
    return random_samples


@pytest.fixture
def make_batch() -> Callable[..., TrainBatch]:
    return random_batch
