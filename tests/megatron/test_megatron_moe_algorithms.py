"""Every registered algorithm trains model=tiny_moe on `train.backend=megatron` with routing replay, end to end through
Ray (megatron-core's MoE layers and router replay, the embedded rollout engine): one step each, megatron-core's
routers replaying the engine's experts on every token (router agreement 1) and a finite loss. The torch backend's
run of the same: tests/runner/test_moe_algorithms.py; the two trainers' parity: test_megatron_cpu.py; learning:
docs/training.md ("Mixture of experts").

Each run starts a Megatron role, the bulk of its cost: the suite's run is PPO's (a critic role beside the Megatron
actor), in test_megatron_training.py's MoE test, which asserts the same (and more, in bf16, over two steps); all of
them run here with RELAX_MATRIX=1 (README, "Contributing"). Every algorithm's training step on the Megatron MoE policy
equals the torch backend's in the suite (test_megatron_cpu.py, `test_moe_every_algorithm_steps_as_the_torch_backend`);
router agreement 1 is shown to fail where routes are not replayed in test_megatron_cpu.py (record mode)."""

from __future__ import annotations

import importlib.util
import math

import pytest

from relax import algorithms

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                 or importlib.util.find_spec("megatron.core") is None,
                                 reason="megatron-core is not installed (pip install -e '.[megatron]')")]


# PPO's run: test_megatron_training.py::test_megatron_trains_tiny_moe_with_routing_replay
IN_SUITE: tuple[str, ...] = ()


@pytest.mark.parametrize("name", [n if n in IN_SUITE else pytest.param(n, marks=pytest.mark.matrix)
                                  for n in algorithms.names()])
def test_every_algorithm_trains_tiny_moe_on_megatron_with_routing_replay(name, tmp_path, ray_local):
    from relax.config import load_config
    from relax.runner.train import run
    from tests.runner.test_distillation import untrained_teacher

    extra = [f"teacher.path={untrained_teacher(tmp_path / 'teacher')}"] if name == "opd" else []
    cfg = load_config([f"algorithm={name}", "model=tiny_moe", "train.backend=megatron", "rollout.routing_replay=true",
                       "model.dtype=float32", "train.num_rollout=1", "rollout.rollout_batch_size=2",
                       "rollout.n_samples_per_prompt=4", "rollout.max_response_len=4", "train.micro_batch_size=8",
                       "train.save=false", "train.save_dir=null", "tracking.enabled=false", "tracking.progress=false",
                       *extra])
    result = run(cfg, output_dir=tmp_path / "out")
    [(step, metrics)] = result.history
    assert step == 0
    assert metrics["rollout/router_agreement"] == 1.0
    assert math.isfinite(metrics["train/loss"])
