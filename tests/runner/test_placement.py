"""Every cluster option and every recipe either starts on the cluster it names or is rejected before start.

A config is composed as `relax-train` composes it, planned by `build_plan`, and started by the runner's own
`Cluster._start_roles` (so `plan.reserve` and `plan.ray_options`, exactly what runs) with lightweight
placeholder actors in place of the workers, on a local Ray instance declared with exactly the GPUs the
cluster option names (Ray schedules GPU requests on declared GPUs on a CPU machine). Every wait is bounded.

Multi-node options would be declared as their total on one node: every process asks for one GPU or a share
of one, each placement-group bundle is one GPU and the group's strategy is PACK (not STRICT_PACK), so a
group that fits the total fits the nodes; nothing ever needs two GPUs of one node together. As shipped,
`cluster=multinode` (like `cluster=8xgpu`) trains with Megatron, which is not built: it is rejected.

Ray starts twice (each start is seconds of CPU and more of waiting), on loopback, without a dashboard: without GPUs
for the CPU cases, then declared with the most GPUs a case names (12), where a placement group holding the others
leaves exactly the case's GPUs free (Ray gives what a placement group holds to no one else), so each case starts on
as many GPUs as its cluster names; the cases are ordered by that count.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

import relax.runner.cluster as cluster_module
import relax.runner.plan as plan_module
from relax.config.compose import conf_dir, load_config
from relax.config.validate import ConfigError
from relax.runner.cluster import Cluster
from relax.runner.errors import RunError
from relax.runner.plan import build_plan, reserve

# its tests share module-scoped Ray instances with declared GPUs: one xdist worker runs them in a row
pytestmark = pytest.mark.xdist_group("placement")

CPUS = 2  # the fewest CPUs of a Ray instance relax-train starts (max(cpu threads, 2))
START_TIMEOUT_S = 90.0  # placeholders start in seconds; a plan Ray cannot place fails here, never hangs
KL = ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01"]
TORCH_ON_8 = ["cluster=8xgpu", "train.backend=torch", "cluster.actor_gpus=1"]

# (overrides: the first names the option, declared GPUs of the cluster)
STARTS = [
    (["cluster=local"], 0),  # sync: the rollout engine in the actor's process
    (["+experiment=m2po_staleness_cpu"], 0),  # fully_async: a rollout process of its own
    (["cluster=1xgpu"], 1),
    (["cluster=1xgpu", "algorithm=ppo", "rollout.num_replicas=3", *KL], 1),  # every role on the one GPU
    (["cluster=1xgpu", "algorithm=opd", "teacher.path=teacher"], 1),  # the distillation teacher on it too
    ([*TORCH_ON_8, "cluster.colocate=false", "cluster.rollout_gpus=2", "rollout.num_replicas=4", *KL], 8),
    ([*TORCH_ON_8, "cluster.colocate=false", "cluster.rollout_gpus=2", "rollout.num_replicas=2", "algorithm=opd",
      "teacher.path=teacher"], 8),  # apart: the teacher on a GPU of its own
    (["cluster=8xgpu"], 8),  # 8 Megatron ranks, one per GPU; the rollout engine and reference on the first
    (["+experiment=ppo_qwen35_9b"], 8),
    (["cluster=8xgpu", "train.tensor_parallel_size=2", "rollout.num_replicas=8"], 8),  # engines spread over GPUs
    (["cluster=8xgpu", "cluster.gpus_per_node=12", "cluster.colocate=false", "cluster.rollout_gpus=4",
      "rollout.num_replicas=4", "train.mode=fully_async"], 12),  # the rollout on GPUs of its own
]
# Valid, but not started here: multinode joins an existing multi-node Ray cluster (cluster.address); the other
# recipes place exactly as grpo_qwen3_4b (their algorithm is all that differs), which starts above, and
# rloo_smollm2_gsm8k_cpu exactly as smollm2_arithmetic_cpu (one CPU actor and rollout; its data is all that differs).
VALID_ONLY = [(["cluster=multinode"], 16), (["+experiment=cispo"], 8), (["+experiment=gspo"], 8),
              (["+experiment=m2po"], 8), (["+experiment=sapo"], 8), (["+experiment=rloo_smollm2_gsm8k_cpu"], 0)]
# Recipes whose plan is exactly that of a started case (the same bundles, and the same Ray options for every
# process: all that Cluster._start_roles passes to Ray), so that starting them again would show nothing new.
SAME_PLACEMENT = [(["+experiment=rloo_vs_grpo_cpu"], ["cluster=local"]),
                  (["+experiment=smollm2_arithmetic_cpu"], ["cluster=local"]),
                  (["+experiment=moe_routing_replay_cpu"], ["cluster=local"]),
                  (["+experiment=shapes_blind_cpu"], ["cluster=local"]),
                  (["+experiment=rloo_qwen3_0.6b_gsm8k"], ["cluster=1xgpu"]),
                  (["+experiment=grpo_qwen3_4b"], ["cluster=8xgpu"])]

# (overrides, a field the message must name)
REJECTED = [
    (["cluster=8xgpu", "train.backend=torch"], "cluster.actor_gpus"),  # torch: one device, not 8
    (["cluster=8xgpu", "train.tensor_parallel_size=3"], "cluster.actor_gpus"),  # 8 GPUs are not tp x dp
    (["cluster=8xgpu", "train.context_parallel_size=2"], "train.context_parallel_size"),  # needs TE attention
    (["cluster=1xgpu", "cluster.num_nodes=2"], "cluster.address"),  # a local Ray is one machine
    (["cluster=1xgpu", "cluster.rollout_gpus=1"], "cluster.rollout_gpus"),  # ignored when colocated
    (["cluster=local", "cluster.actor_gpus=1"], "cluster.actor_gpus"),  # no GPUs to give
    (["cluster=local", "cluster.colocate=false"], "cluster.colocate"),  # CPU roles share the cores anyway
    ([*TORCH_ON_8, "cluster.colocate=false"], "cluster.rollout_gpus"),
    ([*TORCH_ON_8, "cluster.colocate=false", "cluster.rollout_gpus=2", "rollout.num_replicas=3"],
     "rollout.num_replicas"),  # 3 engines cannot split 2 GPUs evenly
    ([*TORCH_ON_8, "cluster.colocate=false", "cluster.rollout_gpus=3", "rollout.num_replicas=3",
      "algorithm=ppo"], "cluster.colocate"),  # PPO runs colocated only
    # apart, the teacher needs a GPU besides the actor's and the rollout's: 1 + 2 + 1 > 3
    ([*TORCH_ON_8, "cluster.gpus_per_node=3", "cluster.colocate=false", "cluster.rollout_gpus=2", "algorithm=opd",
      "teacher.path=teacher"], "cluster.actor_gpus"),
]


def _id(case) -> str:
    return " ".join(case[0])


def _placeholder():
    """A stand-in for every worker class: takes the worker's arguments, reports where Ray put it.

    Defined in a function so that Ray ships it by value (workers need not import this test module)."""

    class Placeholder:
        def __init__(self, *args, **kwargs):
            pass

        def ping(self) -> str:
            return "ok"

        def rendezvous(self) -> tuple[str, int]:  # a Megatron rank's start-up
            return "127.0.0.1", 0

        def setup(self, addr: str, port: int) -> str:
            return "ok"

        def where(self, device: bool = False) -> dict:
            import os

            import ray

            ctx = ray.get_runtime_context()
            out = {"gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
                   "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "node": ctx.get_node_id()}
            if device:
                from relax.models.hf import pick_device

                out["device"] = pick_device().type
            return out

    return Placeholder


MOST_GPUS = max(declared for _, declared in STARTS)


@pytest.fixture(scope="module")
def local_ray():
    """start(gpus): a local Ray with `gpus` GPUs free: without GPUs for 0, else declared with MOST_GPUS and the
    others held by a placement group. Restarted only between the two; the holding group changes with the count."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from relax.runner.plan import LOCAL_RAY_SYSTEM_CONFIG

    state: dict = {}
    if ray.is_initialized():
        ray.shutdown()

    def start(gpus: int):
        assert 0 <= gpus <= MOST_GPUS
        declared = MOST_GPUS if gpus else 0
        if state.get("declared") != declared or not ray.is_initialized():
            if ray.is_initialized():
                ray.shutdown()
            ray.init(num_cpus=CPUS, num_gpus=declared, include_dashboard=False, _node_ip_address="127.0.0.1",
                     logging_level="WARNING", log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
            state.update(declared=declared, held=None)
        if state["held"] is not None:
            remove_placement_group(state["held"])
            state["held"] = None
        if declared - gpus:
            held = placement_group([{"GPU": 1.0}] * (declared - gpus))
            assert held.wait(START_TIMEOUT_S), "could not hold the GPUs the case does not name"
            state["held"] = held
        deadline = time.monotonic() + START_TIMEOUT_S  # a removed group's GPUs come back as Ray reports them
        while ray.available_resources().get("GPU", 0.0) != gpus and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ray.available_resources().get("GPU", 0.0) == gpus, ray.available_resources()
        return ray

    yield start
    ray.shutdown()


def _start(cfg, monkeypatch, device: bool = False) -> dict[str, dict]:
    """Start the plan of `cfg` with placeholders through Cluster._start_roles; where each process landed."""
    import ray

    worker = _placeholder()
    # the GPUs a case does not name are held, not absent: a plan that needs more waits for them, bounded here
    monkeypatch.setattr(plan_module, "PLACEMENT_TIMEOUT_S", START_TIMEOUT_S)
    for name in ("PolicyWorker", "HybridWorker", "ReferenceWorker", "TeacherWorker", "RolloutWorker",
                 "CriticWorker", "AdvantagesWorker", "MegatronRank"):
        monkeypatch.setattr(cluster_module, name, worker)
    # the workers' arguments stay behind: unpickling a RelaxConfig would import torch in every placeholder
    t = cfg.train
    forwarded = SimpleNamespace(train=SimpleNamespace(ref_load=t.ref_load, backend=t.backend,
                                                      tensor_parallel_size=t.tensor_parallel_size,
                                                      pipeline_parallel_size=t.pipeline_parallel_size,
                                                      max_restarts=t.max_restarts),
                                # no heartbeat board: an actor of its own (a process start per case) outside the
                                # plan (no CPU, no GPU, no placement group; not among cluster.actors), which no
                                # case looks at (tests/faults/test_heartbeats.py and the runs on Ray start it)
                                cluster=SimpleNamespace(actor_gpus=cfg.cluster.actor_gpus, heartbeat_timeout_s=None),
                                rollout=SimpleNamespace(backend=cfg.rollout.backend),
                                reward_model=SimpleNamespace(kind=cfg.reward_model.kind,
                                                             engine=cfg.reward_model.engine),
                                plugins=list(cfg.plugins))  # the advantages service is given them
    cluster = Cluster(forwarded, build_plan(cfg), info=SimpleNamespace(pad_token_id=0))
    try:
        cluster._start_roles(timeout_s=START_TIMEOUT_S)
        where = ray.get([a.where.remote(device) for a in cluster.actors], timeout=START_TIMEOUT_S)
        return dict(zip(cluster.processes, where, strict=True))
    finally:
        cluster.__exit__(None, None, None)  # kills the actors (Ray stays: the cluster did not start it)
        cluster._release_placement()


def test_every_option_and_recipe_has_a_case():
    named = {c[0][0] for c in STARTS + REJECTED + VALID_ONLY + SAME_PLACEMENT}
    options = {f"cluster={p.stem}" for p in (conf_dir() / "cluster").glob("*.yaml")}
    options |= {f"+experiment={p.stem}" for p in (conf_dir() / "experiment").glob("*.yaml")}
    assert options - named == set(), "add each new cluster option or recipe to STARTS or REJECTED"
    started = {tuple(c[0]) for c in STARTS}
    assert all(tuple(same) in started for _, same in SAME_PLACEMENT)


def placement(overrides: list[str]) -> tuple:
    """What Ray is asked for when `overrides` starts: the bundles, and every process's Ray options (placement group
    left out: a handle of a reserved group, the same for all)."""
    from relax.runner.plan import ray_options

    plan = build_plan(load_config(overrides))
    group = object()  # stands for reserve(plan)'s group
    options = []
    for r in plan.roles:
        if r.role == "rollout" and plan.rollout_in_actor:
            continue  # not a process: the engine runs in the actor's
        for i in range(r.replicas):
            o = ray_options(plan, r.role, i, placement_group=group if plan.bundles else None,
                            hide_gpus=bool(plan.bundles))
            if "scheduling_strategy" in o:
                strategy = o.pop("scheduling_strategy")
                assert strategy.placement_group is group
                o["bundle"] = strategy.placement_group_bundle_index
            options.append((r.role, i, o))
    return plan.bundles, options


@pytest.mark.parametrize("case", SAME_PLACEMENT, ids=_id)
def test_a_recipe_places_exactly_as_the_started_case_it_names(case):
    recipe, same = case
    assert placement(recipe) == placement(same)
    assert placement(recipe) != placement(["cluster=8xgpu" if same != ["cluster=8xgpu"] else "cluster=1xgpu"])


@pytest.mark.parametrize("case", VALID_ONLY, ids=_id)
def test_valid_for_the_cluster_it_names(case):
    overrides, declared = case
    cfg = load_config(overrides)
    assert cfg.cluster.num_nodes * cfg.cluster.gpus_per_node == declared
    plan = build_plan(cfg)
    assert len(plan.bundles) <= declared and sum(r.replicas * r.gpus for r in plan.roles) <= declared


@pytest.mark.parametrize("case", REJECTED, ids=_id)
def test_rejected_before_start_naming_the_fields(case):
    overrides, field = case
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    hits = [v for v in err.value.violations if field in v.fields]
    assert hits, f"no violation names {field}: {err.value}"
    assert all(field.split(".")[-1] in v.message for v in hits), [v.message for v in hits]


@pytest.mark.slow
def test_too_few_gpus_fail_at_once_with_the_bundles(local_ray, monkeypatch):
    local_ray(0)
    plan = build_plan(load_config(["cluster=1xgpu"]))
    t0 = time.perf_counter()
    with pytest.raises(RunError, match=r"needs 1 GPU\(s\).*has 0 GPU"):
        reserve(plan, timeout_s=60)
    assert time.perf_counter() - t0 < 10


@pytest.mark.slow
@pytest.mark.parametrize("case", STARTS, ids=_id)
def test_starts_on_the_cluster_it_names(case, local_ray, monkeypatch):
    overrides, declared = case
    cfg = load_config(overrides)
    c = cfg.cluster
    assert c.num_nodes * c.gpus_per_node == declared
    plan = build_plan(cfg)
    assert sum(r.replicas * r.gpus for r in plan.roles) <= declared
    local_ray(declared)
    where = _start(cfg, monkeypatch)

    # every process of every role, started (sync on one CPU node: the rollout engine in the actor's process)
    assert len(where) == sum(r.replicas for r in plan.roles) - plan.rollout_in_actor
    gpu_of = {name: w["gpu_ids"] for name, w in where.items()}
    if declared == 0:
        assert all(not ids for ids in gpu_of.values())
        return
    for r in plan.roles:  # every process that asks for a GPU got exactly one; the others none, and see none
        names = [n for n in where if n == r.role or n.startswith(f"{r.role}[")]
        for n in names:
            assert len(gpu_of[n]) == (1 if r.gpus else 0), (n, gpu_of[n])
            assert where[n]["visible"] == ",".join(gpu_of[n])
    actor = plan.role("actor")
    ranks = ["actor"] if actor.replicas == 1 else [f"actor[{i}]" for i in range(actor.replicas)]
    gpu_of_bundle = {actor.bundle(i): gpu_of[n] for i, n in enumerate(ranks)}  # one actor rank per GPU
    assert len({tuple(g) for g in gpu_of_bundle.values()}) == actor.replicas
    for r in plan.roles:
        if r.colocated_with == "actor" and r.gpus:  # colocated: the very GPU of the actor rank of its bundle
            names = [r.role] if r.replicas == 1 else [f"{r.role}[{i}]" for i in range(r.replicas)]
            assert all(gpu_of[n] == gpu_of_bundle[r.bundle(i)] for i, n in enumerate(names)), r.role
    if not c.colocate:  # apart: rollout engines split their own GPUs evenly, none on the actor's
        engines = [gpu_of[n][0] for n in where if n.startswith("rollout")]
        assert not {g[0] for g in gpu_of_bundle.values()} & set(engines)
        per_gpu = {g: engines.count(g) for g in engines}
        assert len(per_gpu) == c.rollout_gpus and set(per_gpu.values()) == {cfg.rollout.num_replicas // c.rollout_gpus}
        if plan.has("teacher"):  # and the teacher on one of its own
            assert gpu_of["teacher"][0] not in {g[0] for g in gpu_of_bundle.values()} | set(engines)


def test_colocated_roles_on_one_gpu_request_shares_not_the_sum():
    """The rule itself: colocated GPU roles sum to at most one GPU, in one bundle."""
    cfg = load_config(["cluster=1xgpu", "algorithm=ppo", "rollout.num_replicas=3"])
    plan = build_plan(cfg)
    assert plan.bundles == ({"GPU": 1.0, "CPU": plan.bundles[0]["CPU"]},)
    assert all(r.bundles == (0,) * r.replicas for r in plan.roles)
    assert 0 < sum(r.replicas * r.gpus for r in plan.roles) <= 1.0
    assert all(0 < r.gpus < 1 for r in plan.roles if r.role != "advantages")
    assert plan.role("advantages").gpus == 0
    assert sum(r.replicas * r.cpus for r in plan.roles) <= plan.bundles[0]["CPU"] + 1e-9
    assert "placement group" in plan.render()


@pytest.mark.slow
def test_busy_gpus_fail_after_the_timeout(local_ray):
    from ray.util.placement_group import placement_group, remove_placement_group

    ray = local_ray(STARTS[-1][1])  # the Ray instance of the last start case: all its GPUs taken
    plan = build_plan(load_config(["cluster=1xgpu"]))
    holder = placement_group([{"GPU": ray.cluster_resources()["GPU"]}])
    assert holder.wait(30)
    try:
        with pytest.raises(RunError, match="could not reserve"):
            reserve(plan, timeout_s=1.0)
    finally:
        remove_placement_group(holder)


@pytest.mark.gpu
@pytest.mark.slow
def test_colocated_roles_compute_on_the_gpu(local_ray, monkeypatch):
    """On a real GPU: every colocated role, with its share of the GPU, sees it and picks device cuda."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    local_ray(1)
    where = _start(load_config(["cluster=1xgpu", "algorithm=ppo"]), monkeypatch, device=True)
    assert {n: w["device"] for n, w in where.items()} == {
        "actor": "cuda", "rollout": "cuda", "critic": "cuda", "advantages": "cpu"}
