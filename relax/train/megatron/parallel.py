"""Process-group set-up of a Megatron trainer rank: torch.distributed (gloo on CPU, NCCL on GPUs) plus
megatron-core's parallel state (tensor, pipeline and data parallel groups) and its RNG tracker."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch


def initialize(
    rank: int,
    world_size: int,
    *,
    master_addr: str,
    master_port: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    seed: int = 0,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
    store: Any = None,
) -> None:
    """Join the trainer's process group and set up megatron-core's parallel state on this rank.

    `backend`: "nccl" when CUDA is available (one GPU per rank: the visible device `LOCAL_RANK`, else 0), else
    "gloo". Data parallel size = world_size / (TP * PP). `expert_parallel_size` (MoE models): the experts spread over
    that many ranks, which are data-parallel ranks of the rest of the model (it divides the data-parallel size at
    TP=1). `store`: rank 0's rendezvous store, already listening on `master_addr:master_port`
    (`relax.models.rendezvous.listening_store` with port 0); without it rank 0 binds `master_port` here. Call once per
    process.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from relax.train.megatron import cpu_compat
    cpu_compat.enable()
    if world_size % (tensor_parallel_size * pipeline_parallel_size):
        raise ValueError(f"world size {world_size} is not a multiple of TP*PP = "
                         f"{tensor_parallel_size}*{pipeline_parallel_size}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not torch.distributed.is_initialized():
        # rank 0's store listens on master_addr only (torch's own, from a tcp:// init_method, on every interface)
        from relax.models.rendezvous import client_store, listening_store

        if store is None:
            make = listening_store if rank == 0 else client_store
            store = make(master_addr, master_port, world_size=world_size, timeout_s=timeout_s)
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                             timeout=timedelta(seconds=timeout_s))
    if (world_size // pipeline_parallel_size) % expert_parallel_size:
        raise ValueError(f"world size {world_size} / PP {pipeline_parallel_size} is not a multiple of EP = "
                         f"{expert_parallel_size}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        expert_model_parallel_size=expert_parallel_size,
    )
    # The tracker of inference_rng_tracker=True makes no CUDA RNG calls; dropout is 0 in every relax model.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def shutdown() -> None:
    """Tear down megatron-core's parallel state and the process group (end of a rank's life)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
