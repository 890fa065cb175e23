"""The embedded engine's decoder for prompts with images (a vision-language model, `relax.models.vision`).

The model's own forward with a `DynamicCache`, as `GenericDecoder` runs any causal LM, plus what images need: the
prompts' images go through the vision tower once per call (`get_image_features`, timed as perf/vision_encode_time),
before the prefill of the distinct prompts; the samples of a group then fork the prompt's KV cache, so an image is
encoded once per prompt whatever the group size. Positions are the model's 3-D rotary positions (`get_rope_index` over
the left-padded prompts); every later token (sampled, or an observation's) continues at the row's next text position
(its real tokens + the rope delta), on all three axes, as `get_rope_index` gives text after the last image. The image
and video placeholder tokens are never sampled (`relax.models.vision.placeholder_ids`).

A vision-language model decodes here whether or not a batch has images, so that its samples always come from the
distribution the trainer scores (`Samples.vision` is then a list, None for each row without images).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from relax.batch import Samples
from relax.metrics import IMAGE_TOKEN_FRAC, IMAGES_PER_SAMPLE, VISION_ENCODE_TIME
from relax.models.vision import ban_placeholders, check_image_tokens, mrope_positions, stack_vision, vision_core
from relax.rollout.decoders import GenericDecoder


class VisionDecoder(GenericDecoder):
    """Prefill/decode of prompts with images; `rows`: one vision input per prompt row of `start` (None: no image).
    `encode_time`: seconds in the vision tower."""

    def __init__(self, model: nn.Module, rows: list[Optional[dict]]):
        super().__init__(model)
        self.rows = rows
        self.encode_time = 0.0

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_len: int) -> torch.Tensor:
        if len(self.rows) != prompt_ids.shape[0]:
            raise ValueError(f"generate: {len(self.rows)} vision inputs for {prompt_ids.shape[0]} prompts")
        self.cache = self._new_cache()
        self.mask = prompt_mask.long()
        check_image_tokens(self.model, prompt_ids, self.rows)
        pixels, grid = stack_vision(self.rows, prompt_ids.device)
        positions, delta = mrope_positions(self.model, prompt_ids, self.mask, grid)
        self.pos = self.mask.sum(-1) + delta.view(-1).to(self.mask.device)
        extra = {}
        if pixels is not None:
            t0 = time.perf_counter()
            encoded = vision_core(self.model).get_image_features(pixels, grid, return_dict=True)
            self.encode_time += time.perf_counter() - t0
            extra = {"mm_encoder_outputs": {"image": encoded}, "image_grid_thw": grid}
        return self._vforward(prompt_ids, positions, **extra)

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        B, S = tokens.shape
        self.mask = torch.cat([self.mask, self.mask.new_ones(B, S)], dim=1)
        text = self.pos[:, None] + torch.arange(S, device=tokens.device)[None, :]
        logits = self._vforward(tokens, text[None].expand(3, -1, -1))
        self.pos = self.pos + S
        return logits

    def _vforward(self, ids: torch.Tensor, positions: torch.Tensor, **extra) -> torch.Tensor:
        kwargs = {self._cache_kw: self.cache}
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **kwargs, **extra)
        return ban_placeholders(out.logits[:, -1], self.model)  # never sampled (relax.models.vision)


def prompt_vision(items: Optional[list]) -> Optional[list]:
    """The `vision` argument of `EmbeddedEngine.generate` for prompt items (`relax.data.PromptItem`): each item's
    images, or None when no item has any."""
    if not items or all(getattr(item, "vision", None) is None for item in items):
        return None
    return [getattr(item, "vision", None) for item in items]


def vision_metrics(samples: Samples) -> dict[str, float]:
    """rollout/images_per_sample, rollout/image_token_frac (image tokens / every prompt and response token) and
    perf/vision_encode_time (where the engines report it) of a batch with images; {} for a text-only batch."""
    if samples.vision is None:
        return {}
    images = sum(0 if v is None else int(v["image_grid_thw"].shape[0]) for v in samples.vision)
    image_tokens = sum(0 if v is None else int(v["image_tokens"]) for v in samples.vision)
    tokens = float(samples.prompt_mask.sum() + samples.present().sum())
    out = {IMAGES_PER_SAMPLE: images / max(1, len(samples)), IMAGE_TOKEN_FRAC: image_tokens / max(1.0, tokens)}
    if samples.vision_time == samples.vision_time:  # NaN: the engines do not report it (SGLang servers)
        out[VISION_ENCODE_TIME] = samples.vision_time
    return out
