"""Weights to SGLang servers over a weight-update group (rollout.sglang.weight_sync=distributed).

The sender is rank 0 of a process group with every server's TP ranks (`/init_weights_update_group`); each bucket
is announced by `/update_weights_from_distributed` (names, dtypes, shapes) and then broadcast from rank 0 (gloo on
CPU tensors, nccl on CUDA tensors). The last bucket carries `weight_version`, so a server reports the new version
only once it has every tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from relax.rollout.sglang import wire
from relax.rollout.sglang.client import post

LOOPBACK = ("127.0.0.1", "localhost")


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

    def broadcast(self, named: Iterable[tuple[str, torch.Tensor]], version: int, *, bucket_bytes: int) -> int:
        """Announce and broadcast every bucket; returns the number of buckets."""
        if self.group is None:
            self.connect()
        buckets = wire.version_buckets(named, bucket_bytes)
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
        """Leave the group (the servers destroy theirs); `broadcast` forms a new one (after a server was replaced)."""
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


class DistributedSync:
    """`WeightSender`'s mode `distributed`: keeps one `BroadcastSync` group, formed anew when the servers change
    (another set of urls, or `regroup`: a server was replaced)."""

    def __init__(self, target: Any, model_cfg: Any = None):
        self.target = target
        self.group: BroadcastSync | None = None

    def send(self, state: Mapping[str, torch.Tensor], version: int, urls: list[str], *, regroup: bool = False) -> int:
        """`state` of `version` to the servers at `urls`; the number of buckets."""
        t = self.target
        if self.group is not None and (regroup or self.group.urls != urls):
            self.close()
        if self.group is None:
            self.group = BroadcastSync(urls, master_address=self._address(), tp_size=t.tp_size,
                                       backend="nccl" if torch.cuda.is_available() else "gloo",
                                       timeout_s=t.timeout_s, api_key=t.api_key)
        return self.group.broadcast(state.items(), version, bucket_bytes=t.bucket_bytes)

    def _address(self) -> str:
        """Where the servers reach this process: loopback when they bind there, else this node's address."""
        if self.target.host in LOOPBACK:
            return "127.0.0.1"
        import ray

        return ray.util.get_node_ip_address()

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
