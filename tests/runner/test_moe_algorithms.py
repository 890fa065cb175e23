"""Every registered algorithm trains model=tiny_moe with routing replay end to end (torch backend, embedded engine,
roles in this process): one step each, the trainer replaying the engine's experts on every token (router agreement
1) and a finite loss. What replay does token by token: tests/models/test_moe.py; learning: docs/training.md."""

from __future__ import annotations

import math

import pytest
from test_distillation import untrained_teacher

from relax import algorithms
from relax.config import load_config
from relax.runner.train import run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", algorithms.names())
def test_every_algorithm_trains_tiny_moe_with_routing_replay(name, in_process, small_run, tmp_path):
    extra = [f"teacher.path={untrained_teacher(tmp_path / 'teacher')}"] if name == "opd" else []
    cfg = load_config(small_run(f"algorithm={name}", "model=tiny_moe", "rollout.routing_replay=true",
                                "rollout.max_response_len=4", "tracking.enabled=false", *extra, steps=1))
    result = run(cfg, output_dir=tmp_path / "out")
    [(step, metrics)] = result.history
    assert step == 0
    assert metrics["rollout/router_agreement"] == 1.0
    assert math.isfinite(metrics["train/loss"])
