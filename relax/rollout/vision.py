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

Observations of multi-turn episodes (`observe`, called by the engine when an episode answers a turn): their tokens
are fed after the turn's last token, at the 3-D positions the model's own `get_rope_index` gives the observation on
its own, shifted to start at the row's next position (text and images alike: `get_rope_index` places each segment
after the largest position before it, so the shift is exact); an observation's images (an image observation,
`relax.agents.render`) are encoded once when it is queued and their features scattered into the forwards that feed
their tokens, one token at a time or in chunks. Each row's observation images are appended to its vision inputs
(`merge_vision`), so the trainer scores the whole episode with every image in token order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from relax.batch import Samples
from relax.metrics import IMAGE_TOKEN_FRAC, IMAGES_PER_SAMPLE, VISION_ENCODE_TIME
from relax.models.vision import (
    ban_placeholders,
    check_image_tokens,
    mrope_positions,
    stack_vision,
    vision_core,
)
from relax.rollout.decoders import GenericDecoder


@dataclass
class _Observation:
    """An observation queued for one row: its tokens, their positions relative to its first one ([3, S], the
    model's own), the position after it (relative), its image features (the vision tower's, in token order) and how
    far feeding it got."""

    tokens: list[int]
    rel: torch.Tensor
    after: int
    features: Optional[torch.Tensor] = None
    deepstack: list[torch.Tensor] = field(default_factory=list)
    skip: int = 1  # the turn's last token, drawn before the observation was known, is fed first (a text position)
    base: Optional[torch.Tensor] = None  # the row's position of the observation's first token, once fed
    fed: int = 0
    used: int = 0  # image features scattered so far


class VisionDecoder(GenericDecoder):
    """Prefill/decode of prompts with images; `rows`: one vision input per prompt row of `start` (None: no image).
    `encode_time`: seconds in the vision tower; `added`: output row -> the vision inputs of its observations."""

    def __init__(self, model: nn.Module, rows: list[Optional[dict]]):
        super().__init__(model)
        self.rows = rows
        self.encode_time = 0.0
        self.queued: list[Optional[_Observation]] = []  # per batch row
        self._output_class: type = dict
        self.added: dict[int, list[dict]] = {}

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_len: int) -> torch.Tensor:
        if len(self.rows) != prompt_ids.shape[0]:
            raise ValueError(f"generate: {len(self.rows)} vision inputs for {prompt_ids.shape[0]} prompts")
        self.cache = self._new_cache()
        self.mask = prompt_mask.long()
        self.queued = [None] * prompt_ids.shape[0]
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
        positions = text[None].expand(3, -1, -1).clone()
        after = self.pos + S
        features: list[torch.Tensor] = []
        deepstack: list[list[torch.Tensor]] = []
        image_id = int(vision_core(self.model).config.image_token_id)
        for k, obs in enumerate(self.queued):
            if obs is None:
                continue
            j = min(obs.skip, S)  # the turn's last token first, at its text position
            obs.skip -= j
            if j == S:
                continue
            if obs.base is None:
                obs.base = self.pos[k] + j
            n = S - j
            fed = tokens[k, j:].tolist()
            if fed != obs.tokens[obs.fed:obs.fed + n]:
                raise RuntimeError(f"row {k}: fed {fed} where its observation continues with "
                                   f"{obs.tokens[obs.fed:obs.fed + n]}")
            positions[:, k, j:] = obs.base + obs.rel[:, obs.fed:obs.fed + n]
            m = sum(1 for t in fed if t == image_id)
            if m:
                features.append(obs.features[obs.used:obs.used + m])
                deepstack.append([d[obs.used:obs.used + m] for d in obs.deepstack])
                obs.used += m
            obs.fed += n
            after[k] = obs.base + obs.after
            if obs.fed == len(obs.tokens):
                self.queued[k] = None
        extra = {}
        if features:  # the observations' images: their features, in the order of their tokens in the batch
            kwargs = {"pooler_output": (torch.cat(features),)}
            layers = [(torch.cat(layer),) for layer in zip(*deepstack, strict=True)]
            if layers:  # Qwen3-VL's deepstack features of the same tokens
                kwargs["deepstack_features"] = layers
            encoded = self._output_class(**kwargs)  # the vision tower's own output class
            extra = {"mm_encoder_outputs": {"image": encoded}}
        logits = self._vforward(tokens, positions, **extra)
        self.pos = after
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        super().keep(rows)
        self.queued = [self.queued[i] for i in rows.tolist()]

    def observe(self, k: int, r: int, tokens: list[int], vision: Optional[dict]) -> None:
        """Batch row `k` (output row `r`) is fed `tokens` after the token it just drew; `vision`: the images the
        tokens hold (None: none), encoded now."""
        if not tokens:  # a watcher's "go on" (relax-serve's streams and stop strings): nothing to feed
            self.queued[k] = None
            return
        dev = self.mask.device
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        grid = None if vision is None else vision["image_grid_thw"].to(dev)
        check_image_tokens(self.model, ids, [vision])
        rel, delta = mrope_positions(self.model, ids, torch.ones_like(ids), grid)
        obs = _Observation(tokens=list(tokens), rel=rel[:, 0].to(self.pos.dtype), after=len(tokens) + int(delta))
        if vision is not None:
            t0 = time.perf_counter()
            encoded = vision_core(self.model).get_image_features(vision["pixel_values"].to(dev), grid,
                                                                 return_dict=True)
            self.encode_time += time.perf_counter() - t0
            self._output_class = type(encoded)
            obs.features = torch.cat(encoded.pooler_output)
            obs.deepstack = [torch.cat(layer) for layer in (getattr(encoded, "deepstack_features", None) or [])]
            self.added.setdefault(r, []).append(vision)
        self.queued[k] = obs

    def _vforward(self, ids: torch.Tensor, positions: torch.Tensor, **extra) -> torch.Tensor:
        kwargs = {self._cache_kw: self.cache}
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **kwargs, **extra)
        return ban_placeholders(out.logits[:, -1], self.model)  # never sampled (relax.models.vision)


def merge_vision(first: Optional[dict], more: list[dict]) -> Optional[dict]:
    """One row's vision inputs: `first` (its prompt's, or None) and then `more` (its observations'), in token order."""
    parts = ([first] if first is not None else []) + list(more)
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    out = {"pixel_values": torch.cat([p["pixel_values"] for p in parts]),
           "image_grid_thw": torch.cat([p["image_grid_thw"] for p in parts]),
           "image_tokens": sum(int(p["image_tokens"]) for p in parts)}
    if all(p.get("image_data") for p in parts):
        out["image_data"] = [u for p in parts for u in p["image_data"]]
    return out


def prompt_vision(items: Optional[list]) -> Optional[list]:
    """The `vision` argument of `EmbeddedEngine.generate` for prompt items (`relax.data.PromptItem`): each item's
    images, or None when no item has any. An item's `vision` computes its pixel values on each access: read once."""
    drawn = [getattr(item, "vision", None) for item in items or []]
    return None if all(v is None for v in drawn) else drawn


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
