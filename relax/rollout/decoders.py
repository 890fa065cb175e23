"""The embedded engine's decoder for any causal LM: the model's own forward with a `DynamicCache` and a growing 2-D
attention mask (`relax.rollout.embedded` runs Llama-family models on a faster decoder of its own; `relax.rollout.vision`
extends this one with images)."""

from __future__ import annotations

import inspect

import torch
from torch import nn


class GenericDecoder:
    """Any causal LM through its own forward, a `DynamicCache` and a growing 2-D attention mask."""

    def __init__(self, model: nn.Module):
        from transformers import DynamicCache

        self.model = model
        self._new_cache = lambda: DynamicCache(config=model.config)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_len: int) -> torch.Tensor:
        self.cache = self._new_cache()
        self.mask = prompt_mask.long()
        self.pos = self.mask.sum(-1)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        return self._forward(prompt_ids, positions)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.extend(tokens[:, None])

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        B, S = tokens.shape
        self.mask = torch.cat([self.mask, self.mask.new_ones(B, S)], dim=1)
        logits = self._forward(tokens, self.pos[:, None] + torch.arange(S, device=tokens.device)[None, :])
        self.pos = self.pos + S
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask = self.mask.index_select(0, rows)
        self.pos = self.pos.index_select(0, rows)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kwargs = {self._cache_kw: self.cache}
        out = self.model(
            input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True, logits_to_keep=1, **kwargs
        )
        return out.logits[:, -1]
