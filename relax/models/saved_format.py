"""Weights saved by `save_pretrained` back under the names (and shapes) of the model in memory.

transformers 5 saves some families in their original checkpoint layout, not the layout of the classes in memory: a
Qwen-VL model's `model.language_model.layers.*` are saved as `model.layers.*` and its `model.visual.*` as `visual.*`;
a Qwen3-MoE layer's fused `mlp.experts.gate_up_proj` / `down_proj` are saved as one `gate_proj` / `up_proj` /
`down_proj` per expert (`revert_weight_conversion`, which `save_pretrained` runs). A checkpoint's `policy/` (the
trainer's `save_pretrained`) is then not the trainer's own `state_dict`, and resuming from it must undo that.

`to_model_layout` undoes it with transformers' own save-time conversion. When that only renames whole tensors (the
Qwen-VL families), the names are mapped back and nothing is copied. Otherwise it runs the conversion on element
indices (transiently about four times the model's fp32 size in memory): each element of the model's state is
numbered, `revert_weight_conversion` moves the numbers as it moves weights (renames, stacks,
concatenations, splits: every conversion these families use moves elements without changing them), and the saved
tensors are written back to the elements their numbers name. Every element must be written exactly once, else the
saved weights do not fit the model and a KeyError says which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # modeling_utils costs seconds to import; the driver only needs the names for hints
    from transformers import PreTrainedModel


def to_model_layout(model: PreTrainedModel, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`saved` (what `model.save_pretrained` wrote, as read from its safetensors) under `model.state_dict()`'s names and
    shapes; `saved` itself when its names are already the model's (a tied weight saved once is left for the caller)."""
    own = model.state_dict()
    if set(saved) <= set(own):
        return saved
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    kept = remove_tied_weights_from_state_dict(dict(own), model)  # the names save_pretrained keeps
    renamed = _renamed_only(model, kept)
    if renamed is not None:  # whole tensors renamed (a Qwen-VL model): no numbering, no copy
        missing, unexpected = sorted(set(renamed) - set(saved)), sorted(set(saved) - set(renamed))
        if missing or unexpected:
            raise KeyError(f"weights do not match the model (in the layout save_pretrained writes): missing "
                           f"{missing[:5]}, unexpected {unexpected[:5]}")
        return {renamed[name]: tensor for name, tensor in saved.items()}
    numbers: dict[str, torch.Tensor] = {}
    start = 0
    for name, tensor in kept.items():  # float64 numbers are exact up to 2**53 elements
        numbers[name] = torch.arange(start, start + tensor.numel(), dtype=torch.float64).view(tensor.shape)
        start += tensor.numel()
    moved = revert_weight_conversion(model, numbers)
    missing, unexpected = sorted(set(moved) - set(saved)), sorted(set(saved) - set(moved))
    if missing or unexpected:
        raise KeyError(f"weights do not match the model (in the layout save_pretrained writes): missing "
                       f"{missing[:5]}, unexpected {unexpected[:5]}")
    dtype = saved[next(iter(saved))].dtype
    for tensor in saved.values():
        dtype = torch.promote_types(dtype, tensor.dtype)
    flat = torch.empty(start, dtype=dtype)
    written = torch.zeros(start, dtype=torch.int32)
    for name, index in moved.items():
        if tuple(index.shape) != tuple(saved[name].shape):
            raise KeyError(f"weights do not match the model: {name} has shape {tuple(saved[name].shape)}, the model "
                           f"saves {tuple(index.shape)}")
        where = index.reshape(-1).long()
        flat[where] = saved[name].reshape(-1).to(dtype)
        written.index_add_(0, where, torch.ones_like(where, dtype=torch.int32))
    if not bool((written == 1).all()):
        raise KeyError("weights do not match the model: the saved tensors do not cover each of its elements once")
    out, start = {}, 0
    for name, tensor in kept.items():
        out[name] = flat[start:start + tensor.numel()].view(tensor.shape)
        start += tensor.numel()
    return out


def _renamed_only(model: PreTrainedModel, kept: dict[str, torch.Tensor]) -> dict[str, str] | None:
    """saved name -> the model's name, when the save-time conversion only renames whole tensors (it then hands back
    the model's own tensors under other names); None when it makes new ones (stacks, splits)."""
    from transformers.core_model_loading import revert_weight_conversion

    names = {(t.data_ptr(), tuple(t.shape), t.dtype): n for n, t in kept.items()}
    out = {}
    for saved_name, tensor in revert_weight_conversion(model, dict(kept)).items():
        name = names.get((tensor.data_ptr(), tuple(tensor.shape), tensor.dtype))
        if name is None:
            return None
        out[saved_name] = name
    return out if len(set(out.values())) == len(kept) else None
