"""Weights to SGLang servers on the sender's node through `/update_weights_from_tensor`
(rollout.sglang.weight_sync=tensor).

Each bucket goes as one call with `load_format=flattened_bucket`: the tensors travel through shared memory (CPU) or
CUDA IPC (GPU), not through the HTTP body, which carries only handles. The last bucket carries `weight_version`, so
a server reports the new version only once it has every tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from relax.rollout.sglang import wire
from relax.rollout.sglang.client import post


def _each(urls: Sequence[str], call) -> list:
    """`call(url)` for every url at once; the first failure is raised after all have answered."""
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        futures = [pool.submit(call, u) for u in urls]
        return [f.result() for f in futures]


def push_tensors(urls: Sequence[str], named: Iterable[tuple[str, torch.Tensor]], version: int, *,
                 bucket_bytes: int, tp_size: int = 1, timeout_s: float = 600.0,
                 device: torch.device | None = None, api_key: str | None = None) -> int:
    """`/update_weights_from_tensor` to every server at `urls`, bucket by bucket; returns the number of buckets.
    `device`: where each bucket is flattened (a CUDA device: the handles are CUDA IPC handles)."""
    buckets = wire.version_buckets(named, bucket_bytes)
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


class TensorSync:
    """`WeightSender`'s mode `tensor`: each version's buckets through shared memory or CUDA IPC (on a GPU, the
    buckets are flattened on this process's device, so the handles are CUDA IPC handles)."""

    def __init__(self, target: Any, model_cfg: Any = None):
        self.target = target

    def send(self, state: Mapping[str, torch.Tensor], version: int, urls: list[str], *, regroup: bool = False) -> int:
        """`state` of `version` to the servers at `urls`; the number of buckets (`regroup`: nothing to form anew)."""
        t = self.target
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        return push_tensors(urls, state.items(), version, bucket_bytes=t.bucket_bytes, tp_size=t.tp_size,
                            timeout_s=t.timeout_s, device=device, api_key=t.api_key)

    def close(self) -> None:
        pass
