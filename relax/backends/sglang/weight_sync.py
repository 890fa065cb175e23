"""Weights to SGLang servers, in flattened buckets, tagged with their version.

- `push_tensors` (rollout.sglang.weight_sync=tensor, servers on the sender's node): each bucket goes as one
  `/update_weights_from_tensor` call with `load_format=flattened_bucket`; the tensors travel through shared
  memory (CPU) or CUDA IPC (GPU), not through the HTTP body, which carries only handles.
- `BroadcastSync` (weight_sync=distributed): the sender is rank 0 of a process group with every server's TP
  ranks (`/init_weights_update_group`); each bucket is announced by `/update_weights_from_distributed` (names,
  dtypes, shapes) and then broadcast from rank 0 (gloo on CPU tensors, nccl on CUDA tensors).

The last bucket carries `weight_version`, so a server reports the new version only once it has every tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from relax.backends.sglang import wire
from relax.backends.sglang.client import post


def _each(urls: Sequence[str], call) -> list:
    """`call(url)` for every url at once; the first failure is raised after all have answered."""
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        futures = [pool.submit(call, u) for u in urls]
        return [f.result() for f in futures]


def _buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    out = list(wire.buckets(((k, v.detach().contiguous()) for k, v in named), bucket_bytes))
    return out or [[]]


def push_tensors(urls: Sequence[str], named: Iterable[tuple[str, torch.Tensor]], version: int, *,
                 bucket_bytes: int, tp_size: int = 1, timeout_s: float = 600.0) -> int:
    """`/update_weights_from_tensor` to every server at `urls`, bucket by bucket; returns the number of buckets."""
    buckets = _buckets(named, bucket_bytes)
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        flat = wire.flatten_bucket(bucket)
        payload = wire.serialize(flat)  # `flat` stays alive until every server answered (shared memory)
        body = {"serialized_named_tensors": [payload] * tp_size, "load_format": "flattened_bucket",
                "flush_cache": last, "weight_version": str(version) if last else None}
        _each(urls, lambda u, body=body: post(u, "/update_weights_from_tensor", body, timeout=timeout_s))
        del flat
    return len(buckets)


class BroadcastSync:
    """Rank 0 of a weight-update group with the servers at `urls` (each `tp_size` ranks)."""

    def __init__(self, urls: Sequence[str], *, master_address: str, backend: str, tp_size: int = 1,
                 group_name: str = "relax_weights", timeout_s: float = 600.0):
        self.urls, self.tp_size, self.group_name = list(urls), tp_size, group_name
        self.master_address, self.backend, self.timeout_s = master_address, backend, timeout_s
        self.group = None

    def connect(self) -> None:
        """Form the group: every server joins (its HTTP call returns once the group exists) while rank 0 does."""
        from relax.backends.sglang.process import free_port

        port = free_port(self.master_address)
        world = 1 + self.tp_size * len(self.urls)

        def join(i_url: tuple[int, str]) -> dict:
            i, url = i_url
            return post(url, "/init_weights_update_group",
                        {"master_address": self.master_address, "master_port": port,
                         "rank_offset": 1 + i * self.tp_size, "world_size": world,
                         "group_name": self.group_name, "backend": self.backend}, timeout=self.timeout_s)

        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            calls = [pool.submit(join, iu) for iu in enumerate(self.urls)]
            self.group = wire.init_update_group(self.master_address, port, 0, world, self.group_name, self.backend,
                                                self.timeout_s)
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
                calls = [pool.submit(post, u, "/update_weights_from_distributed", body, timeout=self.timeout_s)
                         for u in self.urls]
                for _, tensor in bucket:
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
                post(url, "/destroy_weights_update_group", {"group_name": self.group_name}, timeout=30)
            except Exception:  # a dead server has no group to destroy
                pass
        wire.destroy_update_group(self.group)
        self.group = None
