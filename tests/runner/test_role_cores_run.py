"""cluster.role_cores end to end: a fully_async run on a real local Ray with the rollout on core 0 and the actor on
core 1. While the roles run, this test reads every thread's allowed cores of each role process from /proc itself
(not from what the roles report), and the thread counts each process reports; the test's own process, which is not
pinned, is the control that the same reading sees every core. Pinning a process without and with the variable:
tests/config/test_role_cores.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relax.config import load_config
from relax.config.core_rules import parse_cores
from relax.runner.cluster import Cluster
from relax.runner.train import run

pytestmark = pytest.mark.slow


def allowed_cores(pid: int) -> set[tuple[int, ...]]:
    """The distinct Cpus_allowed_list of every thread of process `pid`, as the kernel reports them."""
    masks = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended between the listing and the reading
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                masks.add(parse_cores(line.split(":", 1)[1]))
    return masks


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")
def test_each_role_runs_on_its_cores(ray_local, small_run, tmp_path, monkeypatch):
    seen: dict[str, tuple[dict, set]] = {}
    placement = Cluster.cpu_placement

    def read_while_running(self):
        placed = placement(self)
        for name, p in placed.items():
            seen[name] = (p, allowed_cores(p["pid"]))
        return placed

    monkeypatch.setattr(Cluster, "cpu_placement", read_while_running)
    cfg = load_config(small_run("train.mode=fully_async", "+cluster.role_cores={rollout: '0', actor: '1'}", steps=1))
    result = run(cfg, output_dir=tmp_path / "out")
    assert len(result.history) == 1
    assert set(seen) == {"actor", "rollout"}
    for name, core in (("rollout", 0), ("actor", 1)):
        reported, kernel = seen[name]
        assert kernel == {(core,)}, f"{name}: threads allowed on {kernel}"
        assert reported["pid"] != os.getpid()
        assert (reported["intra_op"], reported["inter_op"]) == (1, 1)
    assert seen["actor"][0]["pid"] != seen["rollout"][0]["pid"]
    # control: the same reading of this process (not pinned) sees all of its cores, two at least
    assert allowed_cores(os.getpid()) == {tuple(sorted(os.sched_getaffinity(0)))}
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(result.run_id).data.tags
    assert tags["relax.cores.rollout"] == "0 (1 threads)" and tags["relax.cores.actor"] == "1 (1 threads)"
