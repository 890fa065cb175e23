"""The local Ray instance a run starts for itself (relax.runner.cluster.RayRuntime)."""

from __future__ import annotations

import os

import pytest

from relax.config.compose import load_config
from relax.runner.cluster import RayRuntime
from relax.runner.plan import build_plan


@pytest.mark.slow
def test_role_processes_run_at_normal_priority(no_ray) -> None:
    """Ray's default starts every worker process at niceness 15, where the driver scoring rewards (or any other
    process of normal priority) takes the cores from the roles; a run's own Ray instance starts them at 0."""
    ray = no_ray  # this test is about the instance a run starts
    cfg = load_config(["tracking.enabled=false"])

    class Probe:
        def niceness(self) -> int:
            return os.nice(0)

    with RayRuntime(cfg, build_plan(cfg)) as runtime:
        assert runtime.started
        actor = ray.remote(Probe).options(num_cpus=0.5).remote()
        task = ray.remote(lambda: os.nice(0)).options(num_cpus=0.25)
        assert ray.get([actor.niceness.remote(), task.remote()], timeout=120) == [os.nice(0), os.nice(0)]
    assert not ray.is_initialized()
