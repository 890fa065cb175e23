"""What travels between a weight sender and an SGLang server, usable on both sides.

- Flattened buckets (`load_format="flattened_bucket"` of `/update_weights_from_tensor`): the tensors of a bucket
  as one 1-D uint8 tensor (each tensor's bytes, concatenated, each starting at a multiple of `ALIGN_BYTES`) plus one
  `FlattenedTensorMetadata` per tensor, the layout of SGLang's `sglang.srt.weight_sync.tensor_bucket` (offsets and
  `numel` count bytes).
- `serialize` / `deserialize`: the `serialized_named_tensors` strings, base64 of a `multiprocessing` ForkingPickler
  dump with torch's reductions registered (what SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`
  produces). Only handles travel: CPU tensors through named shared memory, CUDA tensors as CUDA IPC handles. The
  receiving side unpickles with a restricted unpickler that builds tensors and plain containers and nothing else.
- `init_update_group`: the process group of `/init_weights_update_group`, formed exactly as SGLang forms it
  (its own TCP rendezvous, outside the default process group), so a trainer and a real SGLang server can meet.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import datetime
import functools
import importlib
import io
import logging
import pickle
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp  # registers torch's reductions with ForkingPickler

from relax.models.rendezvous import client_store, listening_store

SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"
ALIGN_BYTES = 16  # where each tensor of a flattened bucket starts


@dataclass
class FlattenedTensorMetadata:
    """Where one tensor lies in a flattened bucket (mirrors SGLang's class of the same name; offsets in bytes)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _metadata_class() -> type:
    """SGLang's metadata class when sglang is importable (a real SGLang server can then unpickle it), else ours."""
    try:
        module = importlib.import_module(SGLANG_METADATA_MODULE)
    except Exception:  # not installed (or not importable here)
        return FlattenedTensorMetadata
    return getattr(module, "FlattenedTensorMetadata", FlattenedTensorMetadata)


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> dict:
    """{"flattened_tensor": 1-D uint8 tensor of every tensor's bytes in order, "metadata": [metadata per tensor]}.

    Each tensor starts at a multiple of `ALIGN_BYTES` (zero bytes in between), so that the receiver can view its
    bytes as its dtype (a view needs an offset divisible by the element size). The tensors must share one device.
    An empty list gives an empty bucket (a server then only applies the request's `weight_version`).
    """
    meta_cls = _metadata_class()
    parts: list[torch.Tensor] = []
    metadata = []
    offset = 0
    for name, tensor in named:
        flat = tensor.detach().contiguous().flatten().view(torch.uint8)
        pad = -offset % ALIGN_BYTES
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=flat.device))
            offset += pad
        parts.append(flat)
        size = flat.numel()
        metadata.append(meta_cls(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                 end_idx=offset + size, numel=size))
        offset += size
    flattened = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return {"flattened_tensor": flattened, "metadata": metadata}


def unflatten_bucket(obj: dict) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a flattened bucket: views into its flattened tensor (copies only of tensors
    that start at an offset their dtype cannot be viewed at)."""
    try:
        flat, metadata = obj["flattened_tensor"], obj["metadata"]
    except (KeyError, TypeError):
        raise ValueError("a flattened bucket is a dict with 'flattened_tensor' and 'metadata'") from None
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.uint8:
        raise ValueError("flattened_tensor must be a 1-D uint8 tensor")
    out = []
    for m in metadata:
        if not (0 <= m.start_idx <= m.end_idx <= flat.numel()):
            raise ValueError(f"{m.name}: bytes [{m.start_idx}, {m.end_idx}) outside the bucket ({flat.numel()} bytes)")
        part = flat[m.start_idx : m.end_idx]
        if m.start_idx % torch.empty((), dtype=m.dtype).element_size():
            part = part.clone()  # a sender that did not align: copy to view as the dtype
        out.append((m.name, part.view(m.dtype).reshape(m.shape)))
    return out


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of `named` of at most `bucket_bytes` bytes each; a larger tensor gets a bucket alone."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1")
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        yield current


def version_buckets(named: Iterable[tuple[str, torch.Tensor]],
                    bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """`buckets` of `named`'s tensors (detached, contiguous) for one weight update: at least one, since the last
    carries the update's version (an update of no tensor is one empty bucket)."""
    return list(buckets(((k, v.detach().contiguous()) for k, v in named), bucket_bytes)) or [[]]


_SHARING_LOCK = threading.Lock()
# torch's shared-memory manager (`torch_shm_manager`, one per process, started on first use) must answer each
# registration within 1 s; a loaded machine can miss that. The call is retried with these pauses, then fails.
SHM_MANAGER_RETRY_S = (0.5, 1.0, 2.0, 4.0)
_log = logging.getLogger(__name__)
_SHM_MANAGER_ERRORS = ("Shared memory manager connection has timed out", "error executing torch_shm_manager")


def _shm_manager_failed(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _SHM_MANAGER_ERRORS)


def _retrying_shm_manager(what: str, call: Any) -> Any:
    """`call()`, again after each pause of `SHM_MANAGER_RETRY_S` while torch's shared-memory manager times out."""
    for pause in (*SHM_MANAGER_RETRY_S, None):
        try:
            return call()
        except RuntimeError as exc:
            if not _shm_manager_failed(exc):
                raise
            if pause is None:
                raise RuntimeError(
                    f"{what}: torch's shared-memory manager (torch_shm_manager) did not answer in "
                    f"{1 + len(SHM_MANAGER_RETRY_S)} tries over {sum(SHM_MANAGER_RETRY_S):.1f} s "
                    f"({str(exc).splitlines()[0]}); the machine "
                    "is overloaded or /dev/shm is full. rollout.sglang.weight_sync=distributed sends weights "
                    "without shared memory") from exc
            _log.warning("%s: torch's shared-memory manager did not answer within 1 s (a loaded machine?); "
                         "trying again in %.1f s", what, pause)
            time.sleep(pause)


def serialize(obj: Any) -> str:
    """base64 of a ForkingPickler dump of `obj` (SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`).

    CPU tensors are moved (in place) into named shared memory (torch's `file_system` sharing strategy, set only for
    this dump): the receiver is an unrelated process, which the default `file_descriptor` strategy cannot reach (it
    needs the sender's multiprocessing authkey). CUDA tensors go as CUDA IPC handles. The payload holds handles, not
    data: the sender must keep the tensors alive until the receiver has answered. A timeout of torch's
    shared-memory manager is retried (`SHM_MANAGER_RETRY_S`).
    """

    def dump() -> bytes:
        buf = io.BytesIO()
        with _SHARING_LOCK:
            previous = torch_mp.get_sharing_strategy()
            torch_mp.set_sharing_strategy("file_system")
            try:
                ForkingPickler(buf).dump(obj)
            finally:
                torch_mp.set_sharing_strategy(previous)
        return buf.getvalue()

    return base64.b64encode(_retrying_shm_manager("sharing weights", dump)).decode("ascii")


_REDUCTIONS = "torch.multiprocessing.reductions"
# the names torch gives the shared-memory segments it makes (`/torch_<pid>_<random>_<n>`): the only files a payload
# may name, so that a sender cannot make a server map any other file of /dev/shm
_SEGMENT_NAME = re.compile(rb"/torch_(\d+)_\d+(_\d+)?")


def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: int, dtype: Any = None, *,
                              owner: Callable[[int], bool] | None = None) -> Any:
    """torch's `rebuild_storage_filename` for segments torch made (`_SEGMENT_NAME`) only, and with `owner`, only
    those whose maker's pid (in the name) it accepts."""
    from torch.multiprocessing import reductions

    name = handle if isinstance(handle, bytes) else str(handle).encode()
    match = _SEGMENT_NAME.fullmatch(name)
    if not match:
        raise pickle.UnpicklingError(f"refused shared-memory segment {name!r}: not one torch made (/torch_<pid>_...)")
    if owner is not None and not owner(int(match.group(1))):
        raise pickle.UnpicklingError(f"refused shared-memory segment {name!r}: made by process {int(match.group(1))}, "
                                     f"not by {getattr(owner, 'describe', lambda: 'an allowed process')()}")
    return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


_ALLOWED_FUNCTIONS = {
    (_REDUCTIONS, "rebuild_tensor"),
    (_REDUCTIONS, "rebuild_cuda_tensor"),
    (_REDUCTIONS, "rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_typed_storage_child"),
    (_REDUCTIONS, "rebuild_storage_empty"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
}
_ALLOWED_CLASSES = {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("collections", "OrderedDict"),
}
_BUILTINS = {"list", "dict", "tuple", "set", "frozenset", "bytearray", "bytes", "str", "int", "float", "complex",
             "bool"}
_METADATA_NAMES = {(SGLANG_METADATA_MODULE, "FlattenedTensorMetadata"), (__name__, "FlattenedTensorMetadata")}


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds torch tensors, storages, dtypes, sizes, plain containers and bucket metadata; refuses anything else.
    `segment_owner`: whose shared-memory segments it maps (by the maker's pid; None: any torch segment)."""

    def __init__(self, file: Any, segment_owner: Callable[[int], bool] | None = None):
        super().__init__(file)
        self.segment_owner = segment_owner

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_NAMES:
            return FlattenedTensorMetadata
        if (module, name) == (_REDUCTIONS, "rebuild_storage_filename"):
            return functools.partial(_rebuild_storage_filename, owner=self.segment_owner)
        if module == "builtins" and name in _BUILTINS:
            return getattr(builtins, name)
        if (module, name) in _ALLOWED_FUNCTIONS or (module, name) in _ALLOWED_CLASSES:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
            if name.endswith("Storage") and isinstance(value, type):  # torch.UntypedStorage, legacy torch.FloatStorage
                return value
        if (module, name) == (_REDUCTIONS, "rebuild_storage_fd"):
            raise pickle.UnpicklingError("refused global torch.multiprocessing.reductions.rebuild_storage_fd: tensors "
                                         "shared by file descriptor need the sender's authkey; serialize with the "
                                         "file_system sharing strategy (relax.rollout.sglang.wire.serialize)")
        raise pickle.UnpicklingError(f"refused global {module}.{name}: only tensors, torch storages, dtypes, sizes, "
                                     "plain containers and FlattenedTensorMetadata may be unpickled")


def deserialize(payload: str | bytes, *, segment_owner: Callable[[int], bool] | None = None) -> Any:
    """The object `serialize` (or SGLang's MultiprocessingSerializer) encoded, through a restricted unpickler.
    `segment_owner(pid)`: whether shared-memory segments made by process `pid` may be mapped (a server: only the
    sender's, `relax.serve.sglang.guards`); None: any segment torch made.

    Raises `pickle.UnpicklingError` naming a refused global, `ValueError` for a payload that is not base64. A
    timeout of torch's shared-memory manager (mapping a segment registers it) is retried as in `serialize`.
    """
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise ValueError(f"serialized tensors are not valid base64: {exc}") from None
    return _retrying_shm_manager("mapping shared weights",
                                 lambda: _RestrictedUnpickler(io.BytesIO(data), segment_owner).load())


def host_update_store(master_address: str, timeout_s: float) -> tuple[Any, int]:
    """Rank 0's rendezvous store of a weight-update group, and its port: (store, port).

    The store binds port 0 (on `master_address` only: `listening_store`), so the kernel picks a free port as it
    binds: no other process can take it in between (a port found free and bound a moment later can be taken, and
    the servers would then be sent to a port their rank 0 does not hold). Tell the other ranks this port, then pass
    the store to `init_update_group(..., store=)`.
    """
    store = listening_store(master_address, 0, timeout_s=timeout_s)
    return store, int(store.port)


def init_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str, timeout_s: float, *, store: Any = None) -> Any:
    """Join the weight-update process group `group_name` as `rank` of `world_size`, as SGLang does.

    Rendezvous on `tcp://master_address:master_port` (rank 0 hosts the store; `store`: rank 0's store, already
    listening, from `host_update_store`), the group's keys under the prefix `group_name`, and a process group that
    is not the default group (none is needed, none is created), so it can be used beside any other. Returns once
    every rank joined; use it as `torch.distributed.broadcast(t, src=0, group=g)`. Backend: gloo for CPU tensors,
    nccl for CUDA tensors.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:  # rank 0's store listens on master_address alone (torch's own: on every interface)
        make = listening_store if int(rank) == 0 else client_store
        store = make(master_address, int(master_port), world_size=int(world_size), timeout_s=timeout_s)
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    # global_ranks_in_group=[]: the group is built like a default group (its ranks are its own), but not registered
    # as the default one. A default group bound to a device would make torch split the new NCCL communicator from
    # the default group's, whose members are other processes: unbind it meanwhile.
    default = c10d._get_default_group() if c10d.is_initialized() else None
    bound = getattr(default, "bound_device_id", None)
    if bound is not None:
        default.bound_device_id = None
    try:
        group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                                  group_name=group_name, timeout=timeout)
    finally:
        if bound is not None:
            default.bound_device_id = bound
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_update_group(group: Any) -> None:
    """Leave a group made by `init_update_group`."""
    torch.distributed.destroy_process_group(group)
