"""`cluster.role_cores`: each role's processes on CPU cores of their own (docs/operations.md, "Roles on their own
cores"), and the rules that option must satisfy.

On a CPU-only cluster of one node the roles otherwise share every core and take turns (sync) or compete for them
(hybrid, fully_async). With `cluster.role_cores={rollout: "0", actor: "1"}` each role's process is pinned to its
own cores (`os.sched_setaffinity`, `relax.roles.cores`) and its torch thread pools are sized to them, as GPUs give
each role a device of its own. The rules here read the config and this machine's usable cores (the driver's
`os.sched_getaffinity`: a local Ray instance starts the roles on this machine) and report every problem at once
with the rest of the config's (`relax.config.validate`).
"""

from __future__ import annotations

import os

from relax import algorithms
from relax.algorithms.base import Violation
from relax.config.derive import needs_reference, teacher_model
from relax.config.megatron_rules import NOT_BUILT
from relax.config.reward_model_rules import has_role as reward_model_has_role
from relax.config.schema import RelaxConfig

KEY = "cluster.role_cores"
# the environment variable that carries a process's cores from the plan (relax.runner.plan.ray_options) to the
# process, which pins itself (relax.roles.cores)
ROLE_CORES_ENV = "RELAX_ROLE_CORES"
# every role that can run as a process of its own (relax.runner.plan); which ones a config has: `process_roles`
ROLES = ("actor", "rollout", "reference", "teacher", "critic", "advantages", "reward_model")


def parse_cores(text: object) -> tuple[int, ...]:
    """A CPU list as taskset and /sys write it ("0-3,6", "1", 2) -> the sorted core numbers; ValueError naming what
    is wrong otherwise (an empty list, a reversed range, a negative or non-integer core)."""
    cores: set[int] = set()
    spec = str(text).strip()
    if not spec:
        raise ValueError("is empty")
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"has {part!r}, which is neither a core number nor a range a-b") from None
        if first < 0 or last < first:
            raise ValueError(f"has {part!r}: cores are numbers >= 0 and a range a-b needs a <= b")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cores(cores: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def process_roles(cfg: RelaxConfig) -> dict[str, int]:
    """The roles of `cfg`'s graph that run as processes on a CPU cluster with the torch trainer and the embedded
    rollout, and how many processes each has (the rollout's replicas). With `cluster.role_cores` the rollout always
    has a process of its own (`relax.runner.plan`); a judge at a URL (reward_model.engine=openai) is no process.
    tests/config/test_role_cores.py checks this against `build_plan`."""
    algo = algorithms.get(cfg.algorithm.name)
    why_ref = needs_reference(cfg)
    reference_on_actor = bool(why_ref) and cfg.model.lora_rank > 0 and not cfg.train.ref_load
    roles = {"actor": 1, "rollout": cfg.rollout.num_replicas}
    if why_ref and not reference_on_actor:
        roles["reference"] = 1
    if teacher_model(cfg) is not None:
        roles["teacher"] = 1
    if algo.requires_critic:
        roles.update(critic=1, advantages=1)
    if reward_model_has_role(cfg):
        roles["reward_model"] = 1
    return roles


def split_cores(cores: tuple[int, ...], processes: int) -> tuple[tuple[int, ...], ...]:
    """A role's cores split into `processes` contiguous, disjoint chunks (the first ones one core larger when they do
    not divide evenly); the rules ensure at least one core per process."""
    base, extra = divmod(len(cores), processes)
    chunks, start = [], 0
    for i in range(processes):
        size = base + (i < extra)
        chunks.append(cores[start:start + size])
        start += size
    return tuple(chunks)


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity: a container's cpuset, a taskset of the launcher)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def role_cores_violations(cfg: RelaxConfig, machine: tuple[int, ...] | None = None) -> list[Violation]:
    """Every broken rule of `cluster.role_cores` (none when it is empty: unset). `machine`: the usable cores (default:
    this process's affinity, `usable_cores`)."""
    c, spec = cfg.cluster, cfg.cluster.role_cores
    if not spec:
        return []
    out: list[Violation] = []

    def require(ok: bool, fields: str | tuple[str, ...], message: str) -> None:
        if not ok:
            out.append(Violation(fields=(fields,) if isinstance(fields, str) else fields, message=message))

    total = c.num_nodes * c.gpus_per_node
    require(total == 0, (KEY, "cluster.gpus_per_node"),
            f"{KEY} pins roles to CPU cores of a CPU-only cluster; cluster={c.name} has {total} GPU(s), where each "
            "role already computes on a device of its own (cluster.colocate, cluster.rollout_gpus)")
    require(c.num_nodes == 1, (KEY, "cluster.num_nodes"),
            f"{KEY} with cluster.num_nodes={c.num_nodes} {NOT_BUILT}: the cores are this machine's, and a "
            "multi-node plan puts the roles on other nodes")
    require(c.address is None, (KEY, "cluster.address"),
            f"{KEY} with cluster.address={c.address} {NOT_BUILT}: the cores are checked against this machine, "
            "and a Ray cluster joined at an address may start the roles on another")
    require(cfg.train.backend == "torch", (KEY, "train.backend"),
            f"{KEY} with train.backend={cfg.train.backend} {NOT_BUILT}: Megatron's ranks are not pinned")
    require(cfg.rollout.backend == "embedded", (KEY, "rollout.backend"),
            f"{KEY} with rollout.backend={cfg.rollout.backend} {NOT_BUILT}: the SGLang servers are processes of "
            "their own, not pinned")
    graph = process_roles(cfg)
    parsed: dict[str, tuple[int, ...]] = {}
    for role, text in spec.items():
        if role not in ROLES:
            require(False, KEY, f"{KEY}.{role}: no such role; roles are {', '.join(ROLES)}")
            continue
        if role not in graph:
            require(False, KEY, f"{KEY}.{role}: this config's graph has no {role} process (its processes: "
                    f"{', '.join(graph)})")
        try:
            parsed[role] = parse_cores(text)
        except ValueError as exc:
            require(False, KEY, f"{KEY}.{role}={text!r} {exc}: write cores as a CPU list such as '0', '0-3' or "
                    "'0,2'")
    missing = [r for r in graph if r not in spec]
    require(not missing, KEY,
            f"{KEY} gives no cores to {', '.join(missing)}: with it every process of the graph runs on cores of its "
            f"own (this config's processes: {', '.join(graph)})")
    names = list(parsed)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = sorted(set(parsed[a]) & set(parsed[b]))
            require(not shared, KEY, f"{KEY}: {a} ({format_cores(parsed[a])}) and {b} ({format_cores(parsed[b])}) "
                    f"share core(s) {format_cores(tuple(shared))}; each role's cores must be its own")
    have = usable_cores() if machine is None else machine
    for role, cores in parsed.items():
        lacking = sorted(set(cores) - set(have))
        require(not lacking, KEY, f"{KEY}.{role}={format_cores(cores)}: this machine has no usable core(s) "
                f"{format_cores(tuple(lacking))} (usable: {format_cores(have)})")
        n = graph.get(role, 1)
        require(len(cores) >= n, (KEY, "rollout.num_replicas") if role == "rollout" else KEY,
                f"{KEY}.{role}={format_cores(cores)} has {len(cores)} core(s) for its {n} processes: each needs one "
                "at least")
    return out
