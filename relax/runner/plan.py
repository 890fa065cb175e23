"""The service graph of a config: which roles exist, how many replicas, which devices, who shares.

Pure: computed from the resolved config alone, printed by `dry_run=true` and used as-is by the Ray
runner to create placement groups and actors, so what a user reads is what runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from relax import algorithms
from relax.config.schema import RelaxConfig
from relax.config.validate import data_parallel_size

# Colocated CPU roles take turns on all cores (sync mode); their Ray requests are token fractions
# so that every role fits on any machine, and torch in each role uses `cpu_threads` threads.
CPU_SHARE = {"actor": 0.5, "rollout": 0.25, "reference": 0.1, "critic": 0.1, "advantages": 0.05}


@dataclass(frozen=True)
class RolePlan:
    role: str
    replicas: int
    backend: str
    gpus: float  # per replica
    cpus: float  # per replica (Ray request)
    colocated_with: str | None
    why: str


@dataclass(frozen=True)
class Plan:
    algorithm: str
    mode: str
    roles: tuple[RolePlan, ...]
    total_gpus: int
    cpu_threads: int
    ray_address: str | None
    data_parallel_size: int

    def role(self, name: str) -> RolePlan | None:
        return next((r for r in self.roles if r.role == name), None)

    def has(self, name: str) -> bool:
        return self.role(name) is not None

    def render(self) -> str:
        device = f"{self.total_gpus} GPU(s)" if self.total_gpus else f"CPU, {self.cpu_threads} threads per role"
        where = self.ray_address or "a local Ray instance started for this run"
        lines = [
            f"Service graph: algorithm={self.algorithm} mode={self.mode} on {device}; Ray: {where}",
            f"  {'role':<11}{'replicas':>8}  {'backend':<10}{'GPUs':>6}{'CPUs':>6}  {'placement':<24}why",
        ]
        for r in self.roles:
            placement = f"shares {r.colocated_with}'s devices" if r.colocated_with else "own devices"
            lines.append(
                f"  {r.role:<11}{r.replicas:>8}  {r.backend:<10}{r.gpus:>6g}{r.cpus:>6g}  {placement:<24}{r.why}"
            )
        return "\n".join(lines)


def needs_reference(cfg: RelaxConfig) -> str | None:
    """Why a reference model is needed, or None: only a KL term needs one."""
    a = cfg.algorithm
    if algorithms.get(a.name).requires_reference:
        return f"{a.name} requires it"
    if a.use_kl_loss:
        return f"KL loss ({a.kl_loss_type})"
    if a.kl_coef != 0:
        return "reward-side KL (kl_coef)"
    return None


def build_plan(cfg: RelaxConfig) -> Plan:
    algo = algorithms.get(cfg.algorithm.name)
    c, t, ro = cfg.cluster, cfg.train, cfg.rollout
    total = c.num_nodes * c.gpus_per_node
    gpu = total > 0
    colocate = c.colocate

    def share(role: str, own_gpus: float) -> tuple[float, float]:
        if gpu:
            return (own_gpus, 1.0)
        return (0.0, CPU_SHARE[role])

    roles = [
        RolePlan("actor", 1, t.backend, *share("actor", c.actor_gpus), None,
                 f"trains the policy ({t.num_steps_per_rollout} step(s) per rollout, dp={data_parallel_size(cfg)})"),
    ]
    if colocate:
        rollout_gpus = 0.0 if not gpu else round(c.actor_gpus / ro.num_replicas, 3)
        rollout_where = "actor"
    else:
        rollout_gpus = c.rollout_gpus / ro.num_replicas
        rollout_where = None
    roles.append(RolePlan("rollout", ro.num_replicas, ro.backend, rollout_gpus if gpu else 0.0,
                          share("rollout", 0)[1], rollout_where,
                          f"{ro.rollout_batch_size} prompts x {ro.n_samples_per_prompt} samples per rollout"))
    why_ref = needs_reference(cfg)
    if why_ref:
        ref = t.ref_load or "the initial policy weights"
        roles.append(RolePlan("reference", 1, t.backend, 0.0, share("reference", 0)[1], "actor",
                              f"{why_ref}; weights: {ref}"))
    if algo.requires_critic:
        critic_gpus = c.actor_gpus if c.critic_gpus is None else c.critic_gpus
        roles.append(RolePlan("critic", 1, t.backend, (critic_gpus if not colocate else 0.0) if gpu else 0.0,
                              share("critic", 0)[1], "actor" if colocate else None, "value model for GAE"))
        roles.append(RolePlan("advantages", 1, "cpu", 0.0, CPU_SHARE["advantages"], None,
                              "GAE advantages and returns from critic values"))
    threads = c.cpus_per_node or os.cpu_count() or 1
    return Plan(algo.name, t.mode, tuple(roles), total, threads, c.address, data_parallel_size(cfg))
