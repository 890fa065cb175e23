"""Weights to SGLang servers, tagged with their version, sent by the trainer's process.

The driver never holds the weights: it describes where they go (`WeightTarget`) and the actor's process (rank 0 of
the Megatron trainer) sends them with a `WeightSender`, from the snapshot of the version being published, by the
protocol of the target's mode (`SYNC_MODES`), each in a file of its own:

- `tensor` (rollout.sglang.weight_sync=tensor, servers on the sender's node): `tensor_sync.py`,
  `/update_weights_from_tensor` with flattened buckets through shared memory or CUDA IPC.
- `distributed` (weight_sync=distributed): `broadcast_sync.py`, a weight-update group with the servers' TP ranks.
- `adapter` (rollout.lora_sync=adapter): `adapter_sync.py`, each version a PEFT directory the servers load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from relax.models.weight_buffers import WeightBuffers, state_and_bytes
from relax.rollout.sglang.adapter_sync import AdapterSync
from relax.rollout.sglang.broadcast_sync import DistributedSync
from relax.rollout.sglang.tensor_sync import TensorSync


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


class ModeSync(Protocol):
    """One mode's sender, built from the target and the model's config, holding what outlives one version."""

    def send(self, state: Mapping[str, torch.Tensor], version: int, urls: list[str], *,
             regroup: bool = False) -> int: ...

    def close(self) -> None: ...


SYNC_MODES: dict[str, type] = {"tensor": TensorSync, "distributed": DistributedSync, "adapter": AdapterSync}


class WeightSender:
    """Sends published weights to the servers, from the process that holds them (the trainer's). One per target:
    its mode's sender keeps what lasts between versions (the weight-update group; the adapter the servers hold)."""

    def __init__(self, target: WeightTarget, model_cfg: Any = None):
        if target.mode not in SYNC_MODES:
            raise ValueError(f"WeightTarget.mode={target.mode!r}: {', '.join(SYNC_MODES)}")
        self.target = target
        self.sync: ModeSync = SYNC_MODES[target.mode](target, model_cfg)

    def push(self, weights: WeightBuffers | Mapping[str, torch.Tensor], version: int, urls: Sequence[str], *,
             regroup: bool = False) -> dict[str, int]:
        """`weights` of `version` to the servers at `urls`; {"buckets", "bytes"} sent. `regroup`: form the
        weight-update group anew (a server was replaced)."""
        state, nbytes = state_and_bytes(weights)
        buckets = self.sync.send(state, version, list(urls), regroup=regroup)
        return {"buckets": buckets, "bytes": nbytes}

    def close(self) -> None:
        self.sync.close()
