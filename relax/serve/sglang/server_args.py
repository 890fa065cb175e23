"""The SGLang server arguments the embedded server reports in `/get_server_info` (`relax.serve.sglang.server`): those
slime compares with its own for an external engine (`_compute_server_args`), as a real SGLang started by a Relax run
(`relax.roles.sglang_server.server_command`) would report them: one process on one device, one node, the run's seed
as `--random-seed`, the tokenizer initialised, and `--enable-memory-saver` exactly when the run is colocated (the
engine releases its memory while the actor trains). A server started without the memory saver refuses
`/release_memory_occupation`, as SGLang does. `--enable-return-routed-experts` exactly when the run replays or records
an MoE model's routes (`return_routed_experts`).
"""

from __future__ import annotations

from typing import Any

import torch

from relax.config.schema import RelaxConfig


def memory_saver(cfg: RelaxConfig) -> bool:
    """Whether a server of `cfg` runs with SGLang's `--enable-memory-saver`: the colocated runs, which release the
    engine's memory while the actor trains."""
    return bool(cfg.cluster.colocate)


def return_routed_experts(cfg: RelaxConfig) -> bool:
    """Whether a server of `cfg` runs with SGLang's `--enable-return-routed-experts`: the runs that replay or record
    the experts the engine routes each token to (`rollout.routing_replay`, `rollout.record_routes`)."""
    return bool(cfg.rollout.routing_replay or cfg.rollout.record_routes)


def server_args(cfg: RelaxConfig, device: torch.device) -> dict[str, Any]:
    """ServerArgs fields of a server of `cfg` on `device` (see the module docstring)."""
    return {"tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0,
            "base_gpu_id": (device.index or 0) if device.type == "cuda" else 0, "gpu_id_step": 1,
            "enable_memory_saver": memory_saver(cfg), "disaggregation_mode": "null", "random_seed": cfg.seed,
            "skip_tokenizer_init": False, "enable_return_routed_experts": return_routed_experts(cfg)}
