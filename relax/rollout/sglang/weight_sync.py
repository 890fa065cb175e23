"""Weights to SGLang servers, in flattened buckets, tagged with their version, sent by the trainer's process.

The driver never holds the weights: it describes where they go (`WeightTarget`) and the actor's process (rank 0 of
the Megatron trainer) sends them with a `WeightSender`, from the snapshot of the version being published.

- `push_tensors` (rollout.sglang.weight_sync=tensor, servers on the sender's node): each bucket goes as one
  `/update_weights_from_tensor` call with `load_format=flattened_bucket`; the tensors travel through shared
  memory (CPU) or CUDA IPC (GPU), not through the HTTP body, which carries only handles.
- `BroadcastSync` (weight_sync=distributed): the sender is rank 0 of a process group with every server's TP
  ranks (`/init_weights_update_group`); each bucket is announced by `/update_weights_from_distributed` (names,
  dtypes, shapes) and then broadcast from rank 0 (gloo on CPU tensors, nccl on CUDA tensors).

- adapters (rollout.lora_sync=adapter): each version is a PEFT directory the servers load (`/load_lora_adapter`).

The last bucket carries `weight_version`, so a server reports the new version only once it has every tensor.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax.models.lora import ADAPTER_WEIGHTS, write_adapter_dir
from relax.models.weight_buffers import WeightBuffers, state_and_bytes
from relax.rollout.sglang import wire
from relax.rollout.sglang.client import post

LOOPBACK = ("127.0.0.1", "localhost")


def _each(urls: Sequence[str], call) -> list:
    """`call(url)` for every url at once; the first failure is raised after all have answered."""
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        futures = [pool.submit(call, u) for u in urls]
        return [f.result() for f in futures]


def _buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    out = list(wire.buckets(((k, v.detach().contiguous()) for k, v in named), bucket_bytes))
    return out or [[]]


def push_tensors(urls: Sequence[str], named: Iterable[tuple[str, torch.Tensor]], version: int, *,
                 bucket_bytes: int, tp_size: int = 1, timeout_s: float = 600.0,
                 device: torch.device | None = None, api_key: str | None = None) -> int:
    """`/update_weights_from_tensor` to every server at `urls`, bucket by bucket; returns the number of buckets.
    `device`: where each bucket is flattened (a CUDA device: the handles are CUDA IPC handles)."""
    buckets = _buckets(named, bucket_bytes)
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        if device is not None:
            bucket = [(k, v.to(device, non_blocking=True)) for k, v in bucket]
        flat = wire.flatten_bucket(bucket)
        payload = wire.serialize(flat)  # `flat` stays alive until every server answered (shared memory)
        body = {"serialized_named_tensors": [payload] * tp_size, "load_format": "flattened_bucket",
                "flush_cache": last, "weight_version": str(version) if last else None}
        _each(urls, lambda u, body=body: post(u, "/update_weights_from_tensor", body, timeout=timeout_s,
                                              api_key=api_key))
        del flat
    return len(buckets)


class BroadcastSync:
    """Rank 0 of a weight-update group with the servers at `urls` (each `tp_size` ranks)."""

    def __init__(self, urls: Sequence[str], *, master_address: str, backend: str, tp_size: int = 1,
                 group_name: str = "relax_weights", timeout_s: float = 600.0, api_key: str | None = None):
        self.urls, self.tp_size, self.group_name, self.api_key = list(urls), tp_size, group_name, api_key
        self.master_address, self.backend, self.timeout_s = master_address, backend, timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        self.group = None

    def connect(self) -> None:
        """Form the group: every server joins (its HTTP call returns once the group exists) while rank 0 does."""

        # rank 0's store listens first, on a port the kernel picked as it bound it; then the servers are told it
        store, port = wire.host_update_store(self.master_address, self.timeout_s)
        world = 1 + self.tp_size * len(self.urls)

        def join(i_url: tuple[int, str]) -> dict:
            i, url = i_url
            return post(url, "/init_weights_update_group",
                        {"master_address": self.master_address, "master_port": port,
                         "rank_offset": 1 + i * self.tp_size, "world_size": world,
                         "group_name": self.group_name, "backend": self.backend}, timeout=self.timeout_s,
                        api_key=self.api_key)

        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            calls = [pool.submit(join, iu) for iu in enumerate(self.urls)]
            self.group = wire.init_update_group(self.master_address, port, 0, world, self.group_name, self.backend,
                                                self.timeout_s, store=store)
            for c in calls:
                c.result()

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int, *, bucket_bytes: int) -> int:
        """Announce and broadcast every bucket; returns the number of buckets."""
        if self.group is None:
            self.connect()
        buckets = _buckets(named, bucket_bytes)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            body = {"names": [k for k, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                    "flush_cache": last, "weight_version": str(version) if last else None}
            with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
                calls = [pool.submit(post, u, "/update_weights_from_distributed", body, timeout=self.timeout_s,
                                     api_key=self.api_key) for u in self.urls]
                for _, tensor in bucket:
                    if self.device is not None:  # nccl broadcasts CUDA tensors
                        tensor = tensor.to(self.device)
                    torch.distributed.broadcast(tensor, src=0, group=self.group)
                for c in calls:
                    c.result()
        return len(buckets)

    def close(self) -> None:
        """Leave the group (the servers destroy theirs); `push` forms a new one (after a server was replaced)."""
        if self.group is None:
            return
        for url in self.urls:
            try:
                post(url, "/destroy_weights_update_group", {"group_name": self.group_name}, timeout=30,
                     api_key=self.api_key)
            except Exception:  # a dead server has no group to destroy
                pass
        wire.destroy_update_group(self.group)
        self.group = None


@dataclass(frozen=True)
class WeightTarget:
    """How the servers take weights, as the driver describes it to the trainer's process (`WeightSender`).

    `mode`: tensor | distributed | adapter (rollout.sglang.weight_sync, or rollout.lora_sync=adapter). `host`:
    rollout.sglang.host; a weight-update group's rendezvous is on the sender's node (loopback when the servers bind
    there). `adapter_root`: where adapter directories are written (a path the servers read). `api_key`: the servers'
    key."""

    mode: str
    bucket_bytes: int
    tp_size: int = 1
    timeout_s: float = 600.0
    host: str = "127.0.0.1"
    adapter_root: str | None = None
    api_key: str | None = None  # the servers' (`--api-key`)


class WeightSender:
    """Sends published weights to the servers, from the process that holds them (the trainer's). One per target:
    it keeps the weight-update group (distributed) and the adapter the servers hold (adapter)."""

    def __init__(self, target: WeightTarget, model_cfg: Any = None):
        if target.mode not in ("tensor", "distributed", "adapter"):
            raise ValueError(f"WeightTarget.mode={target.mode!r}: tensor, distributed or adapter")
        if target.mode == "adapter" and (target.adapter_root is None or model_cfg is None):
            raise ValueError("adapter weight sync needs the adapter directory and the model's config")
        self.target, self.model_cfg = target, model_cfg
        self.group: BroadcastSync | None = None
        self.adapter: str | None = None  # the adapter the servers hold

    def push(self, weights: WeightBuffers | Mapping[str, torch.Tensor], version: int, urls: Sequence[str], *,
             regroup: bool = False) -> dict[str, int]:
        """`weights` of `version` to the servers at `urls`; {"buckets", "bytes"} sent. `regroup`: form the
        weight-update group anew (a server was replaced)."""
        t = self.target
        urls = list(urls)
        state, nbytes = state_and_bytes(weights)
        buckets = 0
        if t.mode == "adapter":
            self._push_adapter(state, version, urls)
        elif t.mode == "tensor":
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            buckets = push_tensors(urls, state.items(), version, bucket_bytes=t.bucket_bytes, tp_size=t.tp_size,
                                   timeout_s=t.timeout_s, device=device, api_key=t.api_key)
        else:
            if self.group is not None and (regroup or self.group.urls != urls):
                self.group.close()
                self.group = None
            if self.group is None:
                self.group = BroadcastSync(urls, master_address=self._address(), tp_size=t.tp_size,
                                           backend="nccl" if torch.cuda.is_available() else "gloo",
                                           timeout_s=t.timeout_s, api_key=t.api_key)
            buckets = self.group.push(state.items(), version, bucket_bytes=t.bucket_bytes)
        return {"buckets": buckets, "bytes": nbytes}

    def _address(self) -> str:
        """Where the servers reach this process: loopback when they bind there, else this node's address."""
        if self.target.host in LOOPBACK:
            return "127.0.0.1"
        import ray

        return ray.util.get_node_ip_address()

    def _push_adapter(self, state: Mapping[str, torch.Tensor], version: int, urls: list[str]) -> None:
        """The adapters of `version` as a PEFT directory that the servers at `urls` load (SGLang's
        `/load_lora_adapter`), the previous adapter unloaded and its directory removed, the version set. A server
        replacing a dead one gets the current adapter (same version: same name)."""

        t, root = self.target, Path(self.target.adapter_root)
        name = adapter_name(version)
        directory = root / name
        if not (directory / ADAPTER_WEIGHTS).is_file():  # written last: a directory without it is unfinished
            write_adapter_dir(directory, dict(state), self.model_cfg)
        for url in urls:
            post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(directory)}, timeout=t.timeout_s,
                 api_key=t.api_key)
            post(url, "/update_weight_version", {"new_version": str(version)}, timeout=t.timeout_s,
                 api_key=t.api_key)
        old, self.adapter = self.adapter, name
        if old is not None and old != name:
            for url in urls:
                post(url, "/unload_lora_adapter", {"lora_name": old}, timeout=t.timeout_s, api_key=t.api_key)
            shutil.rmtree(root / old, ignore_errors=True)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def adapter_name(version: int) -> str:
    """The name under which the servers hold the adapter of `version` (every request names it: `lora_path`)."""
    return f"relax-v{version}"
