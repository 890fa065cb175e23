"""Vision-language models (the Qwen-VL family through transformers): building `model=tiny_vl` from config, loading
real checkpoints, and the forward of prompts with images that the trainer, the reference and the rollout engine share.

Everything about images is the model's own code: `get_image_features` (the vision tower), the placeholder check and
scatter of `forward`, and the multimodal rotary positions (`get_rope_index`: each image's tokens get (t, h, w)
positions, the text after it continues from the image's largest position). Relax only gathers each row's vision
inputs (`Samples.vision`: one `{"pixel_values", "image_grid_thw"}` per row, or None) and computes the 3-D positions
once per call through `get_rope_index`, so that a left-padded prompt, a prompt + response in the trainer and a
KV-cached decode step in the engine all see the positions the model would give the row alone.

Qwen3-VL-MoE (`model.arch=qwen3_vl_moe`, model=tiny_vl_moe) is Qwen3-VL with sparse MLPs: the same forward; its
text model's routers are a registered router family (`relax.models.moe_families`), so the engine records, and the
trainer replays, the experts of every token it routes, image placeholders included (they go through the text layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from relax.config.vision_rules import VISION_ARCHS, VISION_MODEL_TYPES
from relax.data.images import (
    IMAGE_PAD,
    TINY_MERGE_SIZE,
    TINY_PATCH_SIZE,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    build_tiny_vl_tokenizer,
)

__all__ = ["VISION_ARCHS", "VISION_MODEL_TYPES", "build_vision_model", "is_vision_model", "load_vision_model",
           "mrope_positions", "stack_vision", "vision_core", "vision_logits", "check_image_tokens"]


@dataclass(frozen=True)
class TinyVision:
    """The vision tower of `model=tiny_vl` (a few ten thousand parameters): patches of TINY_PATCH_SIZE pixels,
    merged 2x2 into one token."""

    depth: int = 2
    hidden_size: int = 32
    intermediate_size: int = 64
    num_heads: int = 2


def _tiny_token_ids() -> dict[str, int]:
    tok = build_tiny_vl_tokenizer()
    return {name: int(tok.convert_tokens_to_ids(t)) for name, t in
            (("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD), ("vision_start_token_id", VISION_START),
             ("vision_end_token_id", VISION_END))}


def vision_config(model_cfg: Any, vocab_size: int, pad_token_id: int) -> Any:
    """The transformers config of a `source=config` vision-language model (`model.arch`: qwen2_5_vl | qwen3_vl |
    qwen3_vl_moe): the text model from the model config's fields (tied embeddings, sdpa attention, mrope sections over
    head_dim / 2; qwen3_vl_moe: every layer a sparse block of `num_experts` experts of `moe_intermediate_size`, top
    `num_experts_per_tok`), the tiny vision tower (`TinyVision`), the tiny tokenizer's vision token ids."""
    head_dim = model_cfg.head_dim
    half = head_dim // 2
    t = half // 4  # temporal share of the rotary frequencies; the rest split between height and width
    h = (half - t) // 2
    sections = [t, h, half - t - h]
    text = dict(vocab_size=vocab_size, hidden_size=model_cfg.hidden_size, num_hidden_layers=model_cfg.num_layers,
                num_attention_heads=model_cfg.num_attention_heads, num_key_value_heads=model_cfg.num_key_value_heads,
                head_dim=head_dim, intermediate_size=model_cfg.intermediate_size,
                max_position_embeddings=model_cfg.max_position_embeddings, tie_word_embeddings=True,
                pad_token_id=pad_token_id, bos_token_id=None, eos_token_id=None)
    v = TinyVision()
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_heads=v.num_heads, in_channels=3, patch_size=TINY_PATCH_SIZE,
                  spatial_merge_size=TINY_MERGE_SIZE, temporal_patch_size=2, out_hidden_size=model_cfg.hidden_size)
    ids = _tiny_token_ids()
    if model_cfg.arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections,
                                   "type": "mrope"}
        vision.update(window_size=TINY_PATCH_SIZE * TINY_MERGE_SIZE * 2, fullatt_block_indexes=[v.depth - 1])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    elif model_cfg.arch in ("qwen3_vl", "qwen3_vl_moe"):
        from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": sections,
                                   "mrope_interleaved": True}
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
        if model_cfg.arch == "qwen3_vl_moe":  # the same sizes with sparse MLPs (Qwen3-VL-30B-A3B's layout)
            text.update(num_experts=model_cfg.num_experts, num_experts_per_tok=model_cfg.num_experts_per_tok,
                        moe_intermediate_size=model_cfg.moe_intermediate_size, decoder_sparse_step=1,
                        mlp_only_layers=[])
            config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        else:
            config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    else:
        raise ValueError(f"model.arch={model_cfg.arch!r}: vision-language archs are {list(VISION_ARCHS)}")
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config


def _model_class(config: Any) -> type:
    if config.model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration
    if config.model_type == "qwen3_vl":
        from transformers import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration
    if config.model_type == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeForConditionalGeneration

        return Qwen3VLMoeForConditionalGeneration
    raise ValueError(f"model_type {config.model_type!r}: vision-language models are {list(VISION_MODEL_TYPES)}")


def build_vision_model(model_cfg: Any, vocab_size: int, pad_token_id: int, *, seed: int) -> nn.Module:
    """A randomly initialised vision-language model (fp32, CPU) from `model_cfg`, under `seed` (global RNG
    untouched): the same seed gives the same weights in every process."""
    config = vision_config(model_cfg, vocab_size, pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(config)(config)
    return model


def load_vision_model(path: Path, dtype: torch.dtype) -> nn.Module:
    """A vision-language checkpoint of a local directory (no download), in `dtype`, sdpa attention."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    return _model_class(config).from_pretrained(str(path), local_files_only=True, dtype=dtype,
                                                attn_implementation="sdpa")


def vision_core(model: nn.Module) -> Optional[nn.Module]:
    """The module holding the model's own `get_rope_index` (the `...VLModel` inside the conditional-generation model,
    through a LoRA wrapper too); None for a text-only model."""
    for module in model.modules():
        if hasattr(type(module), "get_rope_index") and hasattr(module, "visual"):
            return module
    return None


def is_vision_model(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in VISION_MODEL_TYPES or \
        vision_core(model) is not None


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop gradients into the vision tower (`model.freeze_vision_tower`); returns how many parameters it froze."""
    core = vision_core(model)
    if core is None:
        raise ValueError("model.freeze_vision_tower: the model has no vision tower")
    n = 0
    for p in core.visual.parameters():
        p.requires_grad_(False)
        n += p.numel()
    return n


def stack_vision(rows: list[Optional[dict]], device: torch.device | str) -> tuple[Optional[torch.Tensor],
                                                                                 Optional[torch.Tensor]]:
    """(pixel_values, image_grid_thw) of the rows in order (the order `get_rope_index` and the placeholder scatter
    pair them with the image tokens), None when no row has an image."""
    pixels = [r["pixel_values"] for r in rows if r is not None]
    if not pixels:
        return None, None
    grids = [r["image_grid_thw"] for r in rows if r is not None]
    return torch.cat(pixels).to(device), torch.cat(grids).to(device)


def token_types(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """mm_token_type_ids of `input_ids`: 1 on the model's image token, 0 elsewhere (no video input here)."""
    return (input_ids == _image_token_id(model)).int()


def _image_token_id(model: nn.Module) -> int:
    core = vision_core(model)
    return int(core.config.image_token_id)


def mrope_positions(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    image_grid_thw: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(position ids [3, N, L], rope delta [N, 1]) of left-padded rows by the model's own `get_rope_index`; the
    position of the token after a row's last one is (its real tokens + delta)."""
    core = vision_core(model)
    return core.get_rope_index(input_ids, mm_token_type_ids=token_types(model, input_ids),
                               image_grid_thw=image_grid_thw, attention_mask=attention_mask)


def merge_size(model: nn.Module) -> int:
    return int(vision_core(model).config.vision_config.spatial_merge_size)


def check_image_tokens(model: nn.Module, input_ids: torch.Tensor, rows: list[Optional[dict]]) -> None:
    """Each row holds exactly as many image tokens as its images' grids say (patches / merge^2): a row whose
    placeholders and images disagree (a truncated prompt, a split image) is a ValueError naming the row."""
    image_id, merge = _image_token_id(model), merge_size(model)
    found = (input_ids == image_id).sum(-1).tolist()
    for i, (n, row) in enumerate(zip(found, rows, strict=True)):
        want = 0 if row is None else int((row["image_grid_thw"].prod(-1) // (merge * merge)).sum())
        if n != want:
            raise ValueError(f"row {i}: {n} image tokens but its images need {want}")


def vision_inputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  rows: list[Optional[dict]]) -> dict:
    """The keyword inputs of a forward over left-padded rows with their images: the ids and mask, the 3-D positions of
    `mrope_positions`, the rows' pixel values and image grids (each row's image tokens checked against its grids)."""
    check_image_tokens(model, input_ids, rows)
    pixels, grid = stack_vision(rows, input_ids.device)
    positions, _ = mrope_positions(model, input_ids, attention_mask, grid)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, pixel_values=pixels,
                image_grid_thw=grid, use_cache=False)


def vision_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  rows: list[Optional[dict]], *, logits_to_keep: int) -> torch.Tensor:
    """The logits of the last `logits_to_keep` positions of left-padded rows with their images: one forward of the
    model with pixel values, the image grids and the 3-D positions of `mrope_positions`."""
    return model(**vision_inputs(model, input_ids, attention_mask, rows), logits_to_keep=logits_to_keep).logits


def vision_hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         rows: list[Optional[dict]], response_start: int, response_len: int) -> torch.Tensor:
    """Last hidden states [N, T, H] at positions P-1 .. P+T-2 (the state before each response token) of left-padded
    rows with their images: `relax.models.hf.response_hidden_states` for a vision-language model, the forward of its
    `...VLModel` (`vision_core`) with the pixel values, the image grids and the 3-D positions, as `vision_logits`."""
    out = vision_core(model)(**vision_inputs(model, input_ids, attention_mask, rows))
    return out.last_hidden_state[:, response_start - 1: response_start + response_len - 1]


def is_vision_config(model_cfg: Any) -> bool:
    """Whether `model_cfg` builds a vision-language model (`relax.data.images.is_vision_model_config`)."""
    from relax.data.images import is_vision_model_config

    return is_vision_model_config(model_cfg)


def build_or_load(model_cfg: Any, vocab_size: int, pad_token_id: int, *, seed: int, dtype: torch.dtype,
                  device: torch.device | str) -> nn.Module:
    """`relax.models.hf.build_model` for a vision-language `model_cfg`: built from config (tiny_vl) under `seed`,
    or loaded from `model.path`; parameters in `dtype` on `device`, no cache, gradient checkpointing as asked."""
    if model_cfg.source == "config":
        model = build_vision_model(model_cfg, vocab_size, pad_token_id, seed=seed)
        for param in model.parameters():  # weights only: buffers (rotary inv_freq) stay fp32, as in build_model
            param.data = param.data.to(dtype)
    else:
        from relax.data.tokenizer import resolve_model_path

        model = load_vision_model(resolve_model_path(model_cfg), dtype)
        n_embed = model.get_input_embeddings().weight.shape[0]
        if vocab_size > n_embed:
            raise ValueError(f"tokenizer vocab_size={vocab_size} exceeds the model's {n_embed} embeddings")
    model.config.use_cache = False
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(device)


def placeholder_ids(model: nn.Module) -> list[int]:
    """The model's image and video placeholder tokens. They stand for vision features in the forward (which pairs
    every one of them with a feature), so a vision-language policy never generates them: the engine samples from,
    and the trainer scores, the distribution with these tokens at -inf (the same distribution on both sides)."""
    config = vision_core(model).config
    return sorted({int(config.image_token_id), int(config.video_token_id)})


def ban_placeholders(logits: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """`logits` [..., V] with the placeholder tokens (`placeholder_ids`) at -inf (a copy)."""
    out = logits.clone()
    out[..., placeholder_ids(model)] = float("-inf")
    return out


def vision_response_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             rows: list[Optional[dict]], response_start: int, response_len: int, *,
                             temperature: float = 1.0,
                             entropy: str = "none") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log p(response token) [N, T] fp32, entropy [N, T] or None) of rows with images, as
    `relax.train.logprobs.response_logprobs` defines them for text (left-padded prompts, the response from column
    `response_start`, `softmax(logits / temperature)`, 0 at masked positions; entropy "grad" | "metric" | "none"):
    the logits of positions P-1 .. P+T-2 from `vision_logits`, an fp32 log-softmax over the vocabulary without the
    placeholder tokens (`placeholder_ids`), as the engine samples."""
    P, T = response_start, response_len
    logits = vision_logits(model, input_ids, attention_mask, rows, logits_to_keep=T + 1)[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(ban_placeholders(logits, model), dim=-1)
    valid = attention_mask[:, P:] != 0
    logp = logp_all.gather(-1, input_ids[:, P:].unsqueeze(-1)).squeeze(-1).masked_fill(~valid, 0.0)
    if entropy == "none":
        return logp, None
    ent = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
    if entropy == "metric":
        ent = ent.detach()
    return logp, ent.masked_fill(~valid, 0.0)


def frozen_tower(model_cfg: Any) -> bool:
    """Whether a trainer of `model_cfg` freezes the vision tower: `model.freeze_vision_tower`, None meaning true with
    LoRA (lora_rank > 0) and false otherwise; always false for a text-only model."""
    if not is_vision_config(model_cfg):
        return False
    choice = getattr(model_cfg, "freeze_vision_tower", None)
    return bool(model_cfg.lora_rank > 0 if choice is None else choice)
