"""rollout=sglang on several actor GPUs: which actor rank sends each server its weights, and which paths cannot work.

CUDA IPC handles (weight_sync=tensor on GPUs) open only in a process on the GPU that made them, and NCCL refuses two
ranks of one group on one GPU. So, colocated, rollout replica i (on the GPU of bundle i mod ranks) must get its
handles from the actor rank on that GPU, on one node or several; a weight-update group (distributed) colocated on GPUs,
and tensor with the servers on GPUs of their own, are rejected before anything starts. Pure plan and config checks,
plus the driver's routing (`actor_push` with the plan's senders) over in-process stand-ins of the Megatron ranks, each
of which accepts only the servers on its own GPU, as CUDA IPC would. The real GPUs: tests/gpu/test_bare_gpu.py.
"""

from __future__ import annotations

import inspect

import pytest

from relax.config import ConfigError, load_config
from relax.runner.plan import build_plan

SGLANG = ["rollout=sglang", "rollout.sglang.server=embedded"]
EIGHT = [*SGLANG, "cluster=8xgpu", "rollout.num_replicas=16"]  # 8 Megatron ranks, two engines on each GPU
NODES = [*SGLANG, "cluster=multinode", "rollout.sglang.host=0.0.0.0", "rollout.num_replicas=16"]  # 2 x 8 GPUs


def _violations(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load_config(list(overrides))
    return {f: v.message for v in err.value.violations for f in v.fields}


@pytest.mark.parametrize("overrides", [EIGHT, NODES], ids=["one-node", "two-nodes"])
def test_each_colocated_server_gets_weights_from_the_actor_rank_on_its_gpu(overrides):
    """Every replica's sender is the actor rank in the replica's bundle (a bundle is one GPU, so one node), whatever
    the number of nodes; two replicas per GPU both from that GPU's rank; dry_run names the ranks."""
    cfg = load_config(overrides)
    assert cfg.rollout.sglang.weight_sync == "tensor"  # derived colocated on GPUs, on several nodes too
    plan = build_plan(cfg)
    actor, rollout = plan.role("actor"), plan.role("rollout")
    assert plan.weight_path == "tensor" and len(plan.weight_senders) == rollout.replicas == 16
    for i, rank in enumerate(plan.weight_senders):
        assert actor.bundles[rank] == rollout.bundles[i], (i, rank)  # the same GPU
    assert sorted(set(plan.weight_senders)) == list(range(actor.replicas))  # every GPU's rank sends
    assert plan.sent_by(1) == tuple(range(1, 16, actor.replicas))  # replica i on the GPU of rank i mod ranks
    text = plan.render()
    assert "each replica from the actor rank on its GPU" in text and "rank 1 -> replica" in text


def test_one_sender_where_the_path_has_one():
    """A weight-update group (apart on GPUs), shared memory on a CPU node and servers given by URL: rank 0 sends."""
    apart = build_plan(load_config([*SGLANG, "cluster=8xgpu", "cluster.gpus_per_node=12", "cluster.colocate=false",
                                    "cluster.rollout_gpus=4", "rollout.num_replicas=4"]))
    assert apart.weight_path == "distributed" and apart.weight_senders == (0, 0, 0, 0)
    assert "distributed, from actor rank 0 to every replica" in apart.render()
    cpu = build_plan(load_config([*SGLANG, "rollout.num_replicas=2"]))
    assert cpu.weight_path == "tensor" and cpu.weight_senders == (0, 0)
    given = build_plan(load_config(["rollout=sglang", "cluster=8xgpu", "rollout.num_replicas=2",
                                    "rollout.sglang.urls=[http://127.0.0.1:1,http://127.0.0.1:2]"]))
    assert given.weight_senders == (0, 0)
    assert build_plan(load_config(["cluster=8xgpu"])).weight_senders == ()  # the embedded rollout: object store


@pytest.mark.parametrize("overrides, fields, says", [
    ([*EIGHT, "rollout.sglang.weight_sync=distributed"], ("rollout.sglang.weight_sync", "cluster.colocate"),
     "NCCL refuses"),
    ([*NODES, "rollout.sglang.weight_sync=distributed"], ("rollout.sglang.weight_sync", "cluster.colocate"),
     "NCCL refuses"),
    ([*SGLANG, "cluster=8xgpu", "cluster.colocate=false", "cluster.rollout_gpus=2", "cluster.actor_gpus=6",
      "rollout.num_replicas=2", "rollout.sglang.weight_sync=tensor"],
     ("rollout.sglang.weight_sync", "cluster.colocate"), "CUDA IPC handles open only"),
    ([*SGLANG, "rollout.sglang.host=0.0.0.0", "cluster.num_nodes=2", "cluster.address=10.0.0.1:6379",
      "rollout.sglang.weight_sync=tensor"], ("rollout.sglang.weight_sync", "cluster.num_nodes"),
     "servers of other nodes cannot open it"),  # CPU nodes: shared memory stays on its node
], ids=["colocated-group", "colocated-group-nodes", "tensor-apart", "tensor-cpu-nodes"])
def test_paths_that_cannot_work_are_rejected_before_start(overrides, fields, says):
    found = _violations(*overrides)
    for f in fields:
        assert says in found.get(f, ""), found


def test_the_driver_sends_each_server_its_weights_from_the_rank_on_its_gpu(in_process, tmp_path):
    """`SGLangEngines` with the run's `actor_push` and the plan's senders: each stand-in rank is asked only for the
    servers on its own GPU (it refuses others, as a CUDA IPC handle of another GPU cannot be opened), all ranks get
    the same snapshot of the version, and a replaced server gets its weights from its GPU's rank again."""
    import ray

    from relax.runner.rollout_driver.sglang_engines import SGLangEngines, actor_push
    from relax.runner.watchdog import Watchdog

    cfg = load_config(EIGHT)
    plan = build_plan(cfg)
    actor = plan.role("actor")
    gpu_of_url = {f"http://10.0.0.{plan.role('rollout').bundles[i]}:{3000 + i}": plan.role("rollout").bundles[i]
                  for i in range(16)}

    class Rank:
        def __init__(self, rank: int):
            self.gpu, self.got = actor.bundles[rank], []

        def push_weights(self, weights, version, urls, target, regroup):
            wrong = [u for u in urls if gpu_of_url[u] != self.gpu]
            assert not wrong, f"the rank on GPU {self.gpu} cannot open handles for {wrong}"
            self.got.append((weights, version, list(urls)))
            return {"buckets": 2, "bytes": 100}

    handles = [ray.remote(Rank).remote(r) for r in range(actor.replicas)]
    objs = [h._obj for h in handles]  # the stand-in's objects (tests/inprocess_ray.py)
    # actor_push's bound on the whole update (issue 44's waits, landing beside this change) where it takes one
    bound = {"timeout_s": 60.0} if "timeout_s" in inspect.signature(actor_push).parameters else {}
    engines = SGLangEngines(cfg, eos_token_ids=(0,), pad_token_id=0, log_dir=tmp_path, start_server=None,
                            push=actor_push(handles[0], Watchdog(None, None), "actor[0]",
                                            ranks=[(h, f"actor[{r}]") for r, h in enumerate(handles)], **bound),
                            senders=list(plan.weight_senders))
    engines.urls = list(gpu_of_url)
    engines._last = ("snapshot-of-3", 3)
    engines._push(engines.urls)
    for r, o in enumerate(objs):
        assert o.got == [("snapshot-of-3", 3, [engines.urls[i] for i in plan.sent_by(r)])]
    assert engines._version == 3 and engines._buckets == 2 and engines._sync_bytes == 100
    engines._push([engines.urls[9]])  # replica 9 replaced: its GPU's rank (9 mod 8 = 1) sends again
    assert objs[1].got[-1] == ("snapshot-of-3", 3, [engines.urls[9]]) and len(objs[0].got) == 1
