"""What each train.mode accepts: derived staleness, the four sync-only algorithms, weight sync and partial rollout."""

from __future__ import annotations

import pytest

from relax.config import ConfigError, load_config
from relax.runner.plan import build_plan, ray_options


def fields(overrides: list[str]) -> set[str]:
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    return {f for v in err.value.violations for f in v.fields}


@pytest.mark.parametrize("mode,staleness", [("sync", 0), ("hybrid", 1), ("fully_async", 1)])
def test_max_staleness_is_derived_from_the_mode(mode, staleness):
    assert load_config(["algorithm=m2po", f"train.mode={mode}"]).train.max_staleness == staleness


@pytest.mark.parametrize("algorithm", ["rloo", "ppo", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("override,field", [("train.mode=fully_async", "train.mode"),
                                            ("train.mode=hybrid", "train.mode"),
                                            ("train.max_staleness=2", "train.max_staleness"),
                                            ("rollout.partial_rollout=true", "rollout.partial_rollout")])
def test_the_four_sync_only_algorithms_reject_asynchronous_training(algorithm, override, field):
    extra = {"reinforce_pp": ["algorithm.kl_coef=0.01"]}.get(algorithm, [])
    assert field in fields([f"algorithm={algorithm}", *extra, override])


# test_the_async_algorithms_run_fully_async_with_partial_rollout: tests/runner/test_async_training.py (it runs them)


CASES = [
    (["train.max_staleness=1"], "train.max_staleness"),  # sync is on-policy
    (["train.mode=hybrid", "train.max_staleness=2"], "train.max_staleness"),  # hybrid is one step off
    (["train.weight_sync_interval=2"], "train.weight_sync_interval"),  # sync publishes every step
    (["train.mode=fully_async", "train.max_staleness=1", "train.weight_sync_interval=3"],
     "train.weight_sync_interval"),  # rarer than max_staleness + 1 could never satisfy the bound
    (["train.weight_sync_interval=0"], "train.weight_sync_interval"),
    (["rollout.partial_rollout=true"], "rollout.partial_rollout"),  # sync never updates weights mid-rollout
    (["train.mode=hybrid", "rollout.partial_rollout=true"], "rollout.partial_rollout"),
    (["train.mode=fully_async", "train.max_staleness=0", "rollout.partial_rollout=true"], "rollout.partial_rollout"),
    (["rollout.partial_rollout_max_aborts=2"], "rollout.partial_rollout_max_aborts"),  # without partial rollout
    (["rollout.mask_offpolicy_in_partial_rollout=true"], "rollout.mask_offpolicy_in_partial_rollout"),
    (["train.mode=fully_async", "train.max_staleness=2", "rollout.partial_rollout=true",
      "rollout.partial_rollout_max_aborts=0"], "rollout.partial_rollout_max_aborts"),
    (["train.mode=fully_async", "cluster=1xgpu"], "cluster.colocate"),  # its own GPUs
    (["train.mode=hybrid", "cluster=1xgpu", "cluster.colocate=false", "cluster.gpus_per_node=2",
      "cluster.rollout_gpus=1"], "cluster.colocate"),
]


@pytest.mark.parametrize("overrides,field", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_mode_rules(overrides, field):
    assert field in fields(["algorithm=m2po", *overrides])


def test_fully_async_with_a_rarer_weight_sync_within_the_bound_is_accepted():
    cfg = load_config(["algorithm=m2po", "train.mode=fully_async", "train.max_staleness=2",
                       "train.weight_sync_interval=3"])
    assert cfg.train.weight_sync_interval == 3


def test_asynchronous_modes_split_the_cores_and_partial_rollout_makes_the_engine_interruptible():
    sync = build_plan(load_config(["algorithm=m2po", "cluster.cpus_per_node=4"]))
    assert sync.threads("rollout") == sync.threads("actor") == 4
    assert ray_options(sync, "rollout")["max_concurrency"] == 1
    fa = build_plan(load_config(["algorithm=m2po", "cluster.cpus_per_node=4", "train.mode=fully_async",
                                 "train.max_staleness=2", "rollout.partial_rollout=true"]))
    assert fa.threads("rollout") == 2 and fa.threads("actor") == 2
    assert ray_options(fa, "rollout")["max_concurrency"] == 2 and ray_options(fa, "actor")["max_concurrency"] == 1
