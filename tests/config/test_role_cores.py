"""cluster.role_cores (relax/config/core_rules.py, the plan, relax.roles.cores): every wrong option rejected at once
before anything starts, the graph's processes as the plan starts them, and a process pinned by the variable the plan
sets (read back from /proc, with the unpinned process as the control). The run on Ray:
tests/runner/test_async_training.py (its fully_async run on Ray).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from relax.config import load_config
from relax.config.core_rules import format_cores, parse_cores, process_roles, split_cores
from relax.config.validate import ConfigError
from relax.runner.plan import build_plan, ray_options

CORES = "+cluster.role_cores"
ASYNC = "train.mode=fully_async"


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides))
    return [v.message for v in info.value.violations]


def test_cpu_lists_parse_and_split():
    assert parse_cores("0-2,5") == (0, 1, 2, 5) and parse_cores(3) == (3,) and parse_cores(" 4 , 1-2") == (1, 2, 4)
    for bad in ("", "a", "3-1", "-1", "1-", "1.5"):
        with pytest.raises(ValueError):
            parse_cores(bad)
    assert format_cores((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert split_cores((0, 1, 2, 3, 4), 2) == ((0, 1, 2), (3, 4)) and split_cores((4,), 1) == ((4,),)


def test_every_wrong_option_is_reported_at_once():
    found = problems("rollout.num_replicas=2", "algorithm=ppo", "cluster.num_nodes=2",
                     f"{CORES}={{rollout: '0', actor: '0-1', reference: '5', bogus: '2', critic: 'x-1', "
                     "advantages: '4096'}")
    expected = [
        "cluster.role_cores with cluster.num_nodes=2 is not available",
        "cluster.role_cores.reference: this config's graph has no reference process",
        "cluster.role_cores.bogus: no such role",
        "cluster.role_cores.critic='x-1' has 'x-1', which is neither a core number nor a range",
        "rollout (0) and actor (0-1) share core(s) 0",
        "cluster.role_cores.advantages=4096: this machine has no usable core(s) 4096",
        "cluster.role_cores.rollout=0 has 1 core(s) for its 2 processes",
    ]
    for text in expected:
        assert any(text in m for m in found), (text, found)


def test_roles_left_out_and_clusters_it_does_not_fit():
    assert any("gives no cores to rollout" in m for m in problems(ASYNC, f"{CORES}={{actor: '0'}}"))
    gpu = problems("cluster=1xgpu", f"{CORES}={{rollout: '0', actor: '1'}}")
    assert any("cluster=1xgpu has 1 GPU(s)" in m for m in gpu)
    joined = problems("cluster.address=127.0.0.1:6379", f"{CORES}={{rollout: '0', actor: '1'}}")
    assert any("with cluster.address=127.0.0.1:6379 is not available" in m for m in joined)
    sglang = problems("rollout=sglang", f"{CORES}={{rollout: '0', actor: '1'}}")
    assert any("with rollout.backend=sglang is not available" in m for m in sglang)


@pytest.mark.parametrize("overrides", [
    [], [ASYNC, "rollout.num_replicas=2"], ["algorithm=ppo"], ["algorithm=opd", "teacher.path=t"],
    ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"],
    ["model.lora_rank=4", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"],  # the reference on the actor
    ["reward_model=classifier", "reward_model.path=x"],
    ["reward_model=judge", "reward_model.engine=openai", "reward_model.url=http://127.0.0.1:1/v1",
     "reward_model.path=null"],  # a judge at a URL: no process
])
def test_processes_are_the_plans(overrides):
    """The rules' list of the graph's processes (and each one's count) is the plan's, as it starts them."""
    cfg = load_config(overrides)
    plan = build_plan(cfg)
    started = {r.role: r.replicas for r in plan.roles if r.cpus > 0}
    if plan.rollout_in_actor:  # without role_cores, sync: the engine in the actor's process
        started["rollout"] = cfg.rollout.num_replicas
    assert process_roles(cfg) == started


def test_the_plan_pins_each_process(monkeypatch):
    monkeypatch.setattr("relax.config.core_rules.usable_cores", lambda: tuple(range(8)))  # a machine of 8 cores
    cfg = load_config(["rollout.num_replicas=2", "algorithm=ppo", f"{CORES}={{rollout: '0-2', actor: 3, critic: 4, "
                       "advantages: 5}"])
    plan = build_plan(cfg)
    assert not plan.rollout_in_actor  # sync, yet the rollout in a process of its own, on its cores
    assert [plan.cores_of("rollout", i) for i in (0, 1)] == [(0, 1), (2,)]
    assert (plan.threads("actor"), plan.threads("critic"), plan.threads("rollout")) == (1, 1, 2)
    env = [ray_options(plan, "rollout", i)["runtime_env"]["env_vars"]["RELAX_ROLE_CORES"] for i in (0, 1)]
    assert env == ["0-1", "2"]
    assert "cores 0-1 | 2" in plan.render()
    assert "runtime_env" not in ray_options(build_plan(load_config([ASYNC])), "rollout")


PROBE = """
import json, threading
from pathlib import Path
started = threading.Event()
t = threading.Thread(target=started.wait, daemon=True)
t.start()  # a thread that exists before the pinning (as Ray's do)
from relax.roles.cores import cpu_placement, pin_role_process
def kernel():
    masks = set()
    for task in Path("/proc/self/task").iterdir():
        line = next(x for x in (task / "status").read_text().splitlines() if x.startswith("Cpus_allowed_list:"))
        masks.add(line.split(":", 1)[1].strip())
    return sorted(masks)
before = kernel()
pin_role_process()
p = cpu_placement()
print(json.dumps({"before": before, "after": kernel(), "intra": p["intra_op"], "inter": p["inter_op"],
                  "cores": p["cores"]}))
started.set()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_process_pins_itself_to_the_cores_it_is_given():
    """In a fresh interpreter given RELAX_ROLE_CORES (as Ray's worker is by the plan): every thread, one started before
    the pinning too, on that core alone, read from /proc; before the pinning (the control) on every core."""
    mine = sorted(os.sched_getaffinity(0))
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RELAX_ROLE_CORES": str(mine[-1])})
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["before"] == [format_cores(tuple(mine))]
    assert seen["after"] == [str(mine[-1])]
    assert seen["cores"] == [mine[-1]] and (seen["intra"], seen["inter"]) == (1, 1)
