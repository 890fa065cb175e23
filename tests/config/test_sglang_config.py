"""rollout=sglang: what validation accepts and rejects before anything starts."""

from __future__ import annotations

import pytest

from relax.config import ConfigError, load_config
from relax.runner.plan import build_plan


def rejected(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load_config(list(overrides))
    found: dict[str, str] = {}
    for v in err.value.violations:
        for f in v.fields:
            found[f] = found.get(f, "") + " | " + v.message
    return found


def test_embedded_servers_run_on_cpu_and_launched_sglang_needs_gpus_and_a_hf_model():
    cfg = load_config(["rollout=sglang", "rollout.sglang.server=embedded", "rollout.num_replicas=2"])
    assert cfg.rollout.backend == "sglang" and cfg.rollout.sglang.server == "embedded"
    plan = build_plan(cfg)
    assert plan.role("rollout").replicas == 2 and "sglang" in plan.role("rollout").backend
    found = rejected("rollout=sglang")
    assert "need GPUs" in found["rollout.sglang.server"]
    assert "Hugging Face directory" in found["model.source"]


def test_sglang_fields_without_rollout_sglang_are_rejected():
    found = rejected("rollout.sglang.bucket_mb=64", "rollout.sglang.server=embedded")
    assert "rollout.backend=embedded" in found["rollout.sglang.bucket_mb"]
    assert "rollout.sglang.server" in found


def test_running_servers_set_the_replica_count_and_launch_nothing():
    load_config(["rollout=sglang", "rollout.sglang.urls=[http://127.0.0.1:30000]"])
    found = rejected("rollout=sglang", "rollout.sglang.urls=[http://a:1,b:2]", "rollout.sglang.server=embedded")
    assert "http(s)://" in found["rollout.sglang.urls"]
    assert "rollout.num_replicas=2" in found["rollout.num_replicas"]
    assert "already running" in found["rollout.sglang.server"]


@pytest.mark.parametrize("override,field", [
    ("rollout.sglang.router_policy=fastest", "rollout.sglang.router_policy"),
    ("rollout.sglang.weight_sync=nccl", "rollout.sglang.weight_sync"),
    ("rollout.sglang.bucket_mb=0", "rollout.sglang.bucket_mb"),
    ("rollout.sglang.request_timeout_s=0", "rollout.sglang.request_timeout_s"),
    ("rollout.sglang.max_engine_restarts=-1", "rollout.sglang.max_engine_restarts"),
    ("rollout.sglang.extra_args=[--tp,2]", "rollout.sglang.extra_args"),  # arguments of sglang.launch_server
    ("cluster.rollout_gpus_per_engine=2", "cluster.rollout_gpus_per_engine"),  # the embedded engine has no TP
])
def test_bad_sglang_values_name_their_field(override, field):
    assert field in rejected("rollout=sglang", "rollout.sglang.server=embedded", override)


def test_tensor_parallel_engines_get_gpus_of_their_own():
    base = ["rollout=sglang", "cluster=8xgpu", "model=qwen3_0.6b", "model.source=hf", "model.path=/models/q"]
    found = rejected(*base, "cluster.rollout_gpus_per_engine=2")
    assert "not available in this build" in found["cluster.rollout_gpus_per_engine"]  # colocated TP engines
    apart = ["cluster.colocate=false", "cluster.actor_gpus=4", "cluster.rollout_gpus=4", "rollout.num_replicas=2",
             "cluster.rollout_gpus_per_engine=2"]
    plan = build_plan(load_config(base + apart))
    rollout = plan.role("rollout")
    assert rollout.gpus == 2.0 and [plan.bundles[b]["GPU"] for b in rollout.bundles] == [2.0, 2.0]
    assert "rollout.num_replicas * cluster.rollout_gpus_per_engine" in rejected(
        *base, *apart[:-2], "rollout.num_replicas=4", "cluster.rollout_gpus_per_engine=2")["cluster.rollout_gpus"]


def test_release_memory_only_where_servers_release():
    found = rejected("rollout=sglang", "rollout.sglang.server=embedded", "algorithm=grpo", "train.mode=fully_async",
                     "rollout.sglang.release_memory=false")
    assert "colocated" in found["rollout.sglang.release_memory"]


def _resolved(*overrides: str):
    """The config with its derived fields filled, before the rules run (a multi-node config fails other rules here)."""
    from omegaconf import OmegaConf

    from relax.config import compose, resolve

    return resolve(OmegaConf.to_object(compose(list(overrides))))


def test_weight_sync_defaults_to_shared_memory_only_on_one_node_and_dry_run_says_which():
    """Shared memory (tensor) reaches servers on the trainer's node only: colocated on one node it is the default;
    on several nodes, colocated or not, the default is a weight-update group and tensor is rejected."""
    one = ["rollout=sglang", "rollout.sglang.urls=[http://127.0.0.1:30000]"]
    assert load_config(one).rollout.sglang.weight_sync == "tensor"  # cluster=local colocates
    plan = build_plan(load_config(one)).render()
    assert "weights from the actor's process: tensor (rollout.sglang.weight_sync)" in plan
    assert _resolved(*one, "cluster=8xgpu", "cluster.colocate=false").rollout.sglang.weight_sync == "distributed"
    two = ["rollout=sglang", "rollout.sglang.host=0.0.0.0", "cluster.num_nodes=2"]
    assert _resolved(*two).rollout.sglang.weight_sync == "distributed"  # colocated too
    assert "rollout.sglang.weight_sync" not in rejected(*two)
    found = rejected(*two, "rollout.sglang.weight_sync=tensor")
    assert "cluster.num_nodes=2" in found["rollout.sglang.weight_sync"]
    assert "servers of other nodes cannot open it" in found["rollout.sglang.weight_sync"]
