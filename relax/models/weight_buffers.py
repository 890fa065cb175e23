"""Weights on their way from the actor to the rollout engines, as raw byte arrays.

Ray pickles a dict of torch tensors through `torch.save` on the sender and parses it again with `torch.load` on
every receiver: two extra copies of every weight and a slow parser, on the critical path of each step. A numpy
array, by contrast, travels out of band (pickle protocol 5): Ray copies its bytes into the object store once,
and a receiver on the same node reads them in place from the store's shared memory. `WeightBuffers` holds each
distinct tensor as such an array (a flat `uint8` view, whatever the dtype: numpy has no bfloat16) next to its
name, dtype and shape, so the engine's `copy_` into its own parameters is the only copy a receiver makes.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class WeightBuffers:
    """A state dict as byte arrays: `names[i]` has dtype `dtypes[i]`, shape `shapes[i]` and the bytes of
    `arrays[slots[i]]` (tied weights share one slot, so they travel once)."""

    names: tuple[str, ...]
    slots: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    arrays: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> WeightBuffers:
        """`state`'s CPU tensors, without copying those that are contiguous: the arrays alias them until Ray
        serializes the object (which it does before the sending actor runs its next call)."""
        slot_of: dict[tuple[int, torch.dtype, tuple[int, ...]], int] = {}
        arrays: list[np.ndarray] = []
        slots: list[int] = []
        for name, tensor in state.items():
            if tensor.device.type != "cpu":
                raise ValueError(f"WeightBuffers: {name} is on {tensor.device}; move the weights to the CPU first")
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
            if key not in slot_of:
                slot_of[key] = len(arrays)
                arrays.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            slots.append(slot_of[key])
        return cls(names=tuple(state), slots=tuple(slots), dtypes=tuple(t.dtype for t in state.values()),
                   shapes=tuple(tuple(t.shape) for t in state.values()), arrays=tuple(arrays))

    @property
    def nbytes(self) -> int:
        """Bytes that travel (tied weights counted once)."""
        return sum(a.nbytes for a in self.arrays)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state dict as tensors viewing the arrays: read-only memory of the object store on a receiver, the
        sender's own tensors in its process. Copy what must outlive this object or change."""
        out: dict[str, torch.Tensor] = {}
        with warnings.catch_warnings():  # the store's arrays are read-only; these views are only read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for name, slot, dtype, shape in zip(self.names, self.slots, self.dtypes, self.shapes, strict=True):
                array = self.arrays[slot]
                if array.nbytes == 0:  # numpy gives an empty array stride 0, which no dtype view accepts
                    out[name] = torch.empty(shape, dtype=dtype)
                else:
                    out[name] = torch.from_numpy(array).view(dtype).view(shape)
        return out


def as_state_dict(weights: WeightBuffers | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """What an engine loads: the tensors of `weights`, which is either `WeightBuffers` or already a state dict."""
    return weights.tensors() if isinstance(weights, WeightBuffers) else weights


def weight_bytes(weights: WeightBuffers | Mapping[str, torch.Tensor]) -> int:
    """Bytes of a weight update, tied (shared) tensors counted once."""
    if isinstance(weights, WeightBuffers):
        return weights.nbytes
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in weights.values()}
    return sum(seen.values())


def state_and_bytes(weights: WeightBuffers | Mapping[str, torch.Tensor]) -> tuple[Mapping[str, torch.Tensor], int]:
    """What a weight update sends or loads, read once: its tensors (`as_state_dict`) and their bytes
    (`weight_bytes`)."""
    return as_state_dict(weights), weight_bytes(weights)


def cpu_state(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`named` tensors as a CPU state dict, floating ones in `dtype`; tensors that share storage (tied weights) are
    copied and cast once and shared. The sources are kept alive until the end, so that no address is reused by a
    temporary among them. Without a cast, CPU tensors are aliased, not copied."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, tensor in named:
        ptr = tensor.data_ptr()
        if ptr not in seen:
            t = tensor.detach()
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(device="cpu", dtype=dtype)
            seen[ptr] = (tensor, t.to("cpu"))
        out[name] = seen[ptr][1]
    return out
