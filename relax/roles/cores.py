"""A role's process on the CPU cores the plan gives it (`cluster.role_cores`, relax/config/core_rules.py).

The runner passes the cores in the process's environment (`relax.runner.plan.ray_options`: RELAX_ROLE_CORES, a CPU
list); the role calls `pin_role_process` first thing in its constructor. Every thread the process has by then
(Ray's own, the heartbeat) is pinned, and threads started later inherit the mask of the thread that starts them, so
torch's intra-op pool (created by its first parallel region) and inter-op pool run on those cores only; both pools
are sized to them. Without the variable nothing changes (the role shares every core, as before).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from relax.config.core_rules import ROLE_CORES_ENV, format_cores, parse_cores


class CorePinningError(RuntimeError):
    """The process could not be pinned as the plan says (a core taken away since validation, a pool already
    running): the role fails to start and says why, rather than run elsewhere."""


def _threads_of_process() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def pin_role_process() -> tuple[int, ...] | None:
    """Pin this process to the cores in RELAX_ROLE_CORES and size torch's pools to them; the cores, or None when the
    variable is unset (nothing done). Raises CorePinningError when it cannot do exactly that."""
    spec = os.environ.get(ROLE_CORES_ENV)
    if not spec:
        return None
    cores = parse_cores(spec)
    try:
        for tid in _threads_of_process():
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    except OSError as exc:
        raise CorePinningError(f"cannot pin this role's process to cores {spec} (cluster.role_cores): {exc}; "
                               f"it may use {format_cores(tuple(sorted(os.sched_getaffinity(0))))}") from None
    torch.set_num_threads(len(cores))
    if torch.get_num_interop_threads() != len(cores):
        try:
            torch.set_num_interop_threads(len(cores))
        except RuntimeError as exc:  # torch allows it once, before any inter-op work
            raise CorePinningError(f"cannot size torch's inter-op pool to the {len(cores)} core(s) {spec} of this "
                                   f"role (cluster.role_cores): {exc}") from None
    return cores


def cpu_placement(_role: Any = None) -> dict[str, Any]:
    """Where this process runs: its cores (the affinity of every one of its threads, joined), torch's intra-op and
    inter-op thread counts and the process id. Called in each role's process (`Cluster.cpu_placement`, through
    Ray's `__ray_call__`, which passes the role object)."""
    masks = set()
    for tid in _threads_of_process():
        try:
            masks.add(tuple(sorted(os.sched_getaffinity(tid))))
        except (ProcessLookupError, OSError):  # a thread that ended meanwhile
            pass
    return {"pid": os.getpid(), "cores": tuple(sorted(os.sched_getaffinity(0))),
            "thread_cores": tuple(sorted({c for m in masks for c in m})), "intra_op": torch.get_num_threads(),
            "inter_op": torch.get_num_interop_threads()}
