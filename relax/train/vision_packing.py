"""Packed micro-batches with images (`train.pack_sequences=true`, a vision-language model): the rows as one row
without padding (`relax.train.packing.pack`), each sequence's 3-D rotary positions from the model's own
`get_rope_index` over that sequence alone, and its text positions restarting at 0.

The position ids go to the model as `[4, 1, L]`: the text positions first (from which transformers' mask builder reads
where each packed sequence starts: `find_packed_sequence_indices`, as for text models), then the three rotary axes
(Qwen2.5-VL's and Qwen3-VL's own packed-input form). The rows' images are stacked in row order, which is the order
of their placeholders in the packed row, so the model's placeholder scatter pairs them as in the padded forward. The
log-probs are those of `relax.models.vision.vision_response_logprobs` (placeholders at -inf) up to float rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from relax.batch import Samples
from relax.models.vision import ban_placeholders, check_image_tokens, mrope_positions, stack_vision, vision_core
from relax.train.packing import Packed, pack, response_reach


def packed_vision_inputs(model: nn.Module, mb: Samples, device: torch.device) -> tuple[Packed, dict]:
    """(the packed micro-batch, the keyword inputs of the model's forward over it: input ids, the `[4, 1, L]` position
    ids, the rows' pixel values and image grids); see the module docstring."""
    p = pack(mb).to(device)
    rows = mb.vision if mb.vision is not None else [None] * len(mb)
    lengths = (mb.prompt_mask.sum(-1) + response_reach(mb)).tolist()
    mrope, at = [], 0
    for n, row in zip(lengths, rows, strict=True):  # each sequence's positions, as if alone
        ids = p.input_ids[:, at:at + int(n)]
        check_image_tokens(model, ids, [row])
        grid = None if row is None else row["image_grid_thw"].to(device)
        positions, _ = mrope_positions(model, ids, torch.ones_like(ids), grid)
        mrope.append(positions)
        at += int(n)
    position_ids = torch.cat([p.position_ids[None], torch.cat(mrope, dim=-1)], dim=0)  # [4, 1, L]
    pixels, grid = stack_vision(rows, device)
    return p, dict(input_ids=p.input_ids, position_ids=position_ids, pixel_values=pixels, image_grid_thw=grid,
                   use_cache=False)


def packed_vision_logprobs(model: nn.Module, mb: Samples, device: torch.device, *, temperature: float = 1.0,
                           entropy: str = "none") -> tuple[torch.Tensor, Optional[torch.Tensor], int]:
    """(log p [N, T], entropy [N, T] or None, T) of micro-batch `mb` packed (see the module docstring)."""
    p, inputs = packed_vision_inputs(model, mb, device)
    logits = model(**inputs).logits[0, p.before].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(ban_placeholders(logits, model), dim=-1)
    logp = logp_all.gather(-1, p.targets.unsqueeze(-1)).squeeze(-1)
    if entropy == "none":
        return p.place(logp), None, p.response_len
    ent = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
    if entropy == "metric":
        ent = ent.detach()
    return p.place(logp), p.place(ent), p.response_len


def packed_vision_hidden_states(model: nn.Module, mb: Samples,
                                device: torch.device) -> tuple[Packed, torch.Tensor]:
    """(the packed micro-batch, the last hidden states [n, H] before each of its response tokens, in `Packed.place`
    order) of micro-batch `mb` packed: the critic's packed forward through the model's `...VLModel`."""
    p, inputs = packed_vision_inputs(model, mb, device)
    return p, vision_core(model)(**inputs).last_hidden_state[0, p.before]
