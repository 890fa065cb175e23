"""CPU tensors across Ray calls as raw buffers: what every role process and the driver install before they send.

Ray pickles a torch tensor through torch's own `__reduce_ex__`, which writes each tensor's storage with
`torch.save` into the pickle stream: a fixed cost of a fraction of a millisecond per tensor, paid twice (out and back),
which dominates the calls of a small model's step (a batch of samples carries a dozen tensors). Here a CPU tensor
travels as a NumPy byte array instead, which pickle protocol 5 hands to Ray out of band, and the receiver copies it
into a tensor of its own (writable, independent of Ray's object store), with the same dtype and shape.

What changes for the receiver: a tensor arrives contiguous, holding its own elements only (torch's pickling ships a
view's whole storage); two sent tensors that shared memory arrive as two copies, as they would through any
serialization that does not keep storages. Tensors this does not handle (not on the CPU, requiring grad, sparse or
quantized, subclasses such as `nn.Parameter`) keep torch's own pickling.
"""

from __future__ import annotations

import numpy as np
import torch

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def install() -> None:
    """Send plain CPU tensors as byte arrays from this process's Ray calls (idempotent). Receiving needs nothing:
    the pickle names `rebuild`, which any process that imports relax can run."""
    try:
        from ray import cloudpickle
    except ImportError:  # a process without Ray (the role classes on a bare GPU machine): no Ray calls to send
        return
    cloudpickle.CloudPickler.dispatch[torch.Tensor] = reduce_tensor


def reduce_tensor(t: torch.Tensor):
    """The pickle reduction of `t` (exact type `torch.Tensor`; Ray's pickler dispatches on the exact type)."""
    dtype = str(t.dtype)
    if (t.device.type != "cpu" or t.requires_grad or t.layout != torch.strided or dtype not in _DTYPES
            or t.is_conj() or t.is_neg()):
        return t.__reduce_ex__(5)
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return rebuild, (data, dtype, tuple(t.shape))


def rebuild(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of `reduce_tensor`'s bytes, in memory of its own."""
    if data.size == 0:  # (a 0-byte array's tensor has no element stride to view through)
        return torch.empty(shape, dtype=_DTYPES[dtype])
    return torch.from_numpy(np.array(data, copy=True)).view(_DTYPES[dtype]).reshape(shape)
