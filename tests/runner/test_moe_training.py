"""Mixture-of-experts models and the parity gate through the training loop (roles in this process,
tests/inprocess_ray.py): model=tiny_moe with routing replay, and train.mismatch_gate stopping or skipping on an
engine made to disagree while a normal run is left alone."""

from __future__ import annotations

import pytest
import torch

from relax.config import ConfigError, load_config
from relax.rollout.embedded import EmbeddedEngine
from relax.runner.errors import RunError
from relax.runner.train import run

pytestmark = pytest.mark.slow


def test_tiny_moe_trains_with_replay_and_the_gate_leaves_it_alone(in_process, small_run, tmp_path):
    """model=tiny_moe trains end to end with routing replay: the engine's routes reach the trainer (router agreement
    1 on every step), the load-balancing loss, the router z-loss and the expert load are reported; the parity gate
    (on, stop) leaves this agreeing run alone: the negative control of the gate tests below."""
    cfg = load_config(small_run("model=tiny_moe", "rollout.routing_replay=true", "model.dtype=float32",
                                "train.moe_aux_loss_coef=0.01", "train.moe_z_loss_coef=0.001",
                                "train.mismatch_gate=stop",
                                "train.mismatch_gate_bound=0.05", steps=2))
    result = run(cfg, output_dir=tmp_path / "out")
    assert result.series("rollout/router_agreement") == [1.0, 1.0]
    assert len(result.series("rollout/router_own_agreement")) == 2
    assert len(result.series("train/moe_aux_loss")) == 2
    assert len(result.series("train/moe_z_loss")) == 2
    for name in ("train/moe_expert_load_max_over_mean", "train/moe_expert_load_max_over_mean/layer_1"):
        assert all(1.0 <= v <= 4 / 2 for v in result.series(name)) and len(result.series(name)) == 2
    assert all(torch.isfinite(torch.tensor(result.series("train/loss"))))
    assert result.series("train/mismatch_gate_streak") == [0.0, 0.0]
    assert max(result.series("rollout/mismatch_k3")) < 1e-4


def _disagreeing_engine(monkeypatch, shift: float = 0.5) -> None:
    """Every engine reports each sampled token's log-prob `shift` nats above its true value (an engine whose
    numerics disagree with the trainer's): |trainer - rollout| = shift, k3 = exp(-shift) - 1 + shift."""
    generate = EmbeddedEngine.generate

    def shifted(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        out.rollout_logp = out.rollout_logp + shift * out.response_mask
        return out

    monkeypatch.setattr(EmbeddedEngine, "generate", shifted)


def test_gate_stops_a_run_past_its_bound(in_process, small_run, tmp_path, monkeypatch):
    _disagreeing_engine(monkeypatch)
    cfg = load_config(small_run("train.mismatch_gate=stop", "train.mismatch_gate_bound=0.05",
                                "train.mismatch_gate_steps=2", "model.dtype=float32", steps=4))
    with pytest.raises(RunError) as err:
        run(cfg, output_dir=tmp_path / "out")
    message = str(err.value)
    k3 = torch.tensor(-0.5).exp().item() - 1 + 0.5  # 0.1065
    assert message.startswith("step 2: the train/inference parity gate stopped the run: rollout/mismatch_k3=")
    assert f"{k3:.4g}" in message and "train.mismatch_gate_bound=0.05" in message and "2 rollout(s) in a row" in message


def test_gate_skips_rollouts_past_its_bound(in_process, small_run, tmp_path, monkeypatch):
    """skip: no optimizer step on a rollout past the bound (no loss, the weights those of step 0)."""
    _disagreeing_engine(monkeypatch)
    cfg = load_config(small_run("train.mismatch_gate=skip", "train.mismatch_gate_metric=logp_abs_diff",
                                "train.mismatch_gate_bound=0.2", "model.dtype=float32"))
    result = run(cfg, output_dir=tmp_path / "out")
    assert result.series("train/mismatch_gate_skipped") == [1.0, 1.0]
    assert result.series("train/loss") == []
    diffs = result.series("rollout/train_rollout_logp_abs_diff")
    assert diffs == [pytest.approx(0.5, abs=1e-4)] * 2  # the trainer never moved: the same shift each step


@pytest.mark.parametrize("overrides,field", [
    (["rollout.routing_replay=true"], "model.arch"),  # a dense model
    (["model=tiny_moe", "rollout.routing_replay=true", "rollout=sglang", "rollout.sglang.server=sglang"],
     "rollout.sglang.server"),  # sglang-router 0.3.2 drops return_routed_experts
    (["train.backend=megatron", "train.moe_aux_loss_coef=0.01"], "model.arch"),  # a dense model, either backend
    (["train.expert_parallel_size=2"], "train.backend"),  # the torch backend
    (["train.backend=megatron", "train.expert_parallel_size=2"], "model.arch"),  # a dense model
    (["model=tiny_moe", "train.backend=megatron", "train.expert_parallel_size=3"], "model.num_experts"),
    (["model=tiny_moe", "train.backend=megatron", "train.expert_parallel_size=2"], "cluster.actor_gpus"),  # 1 rank
    (["model=tiny_moe", "train.backend=megatron", "train.tensor_parallel_size=2"], "train.tensor_parallel_size"),
    (["model=tiny_moe", "rollout.routing_replay=true", "model.gradient_checkpointing=true"],
     "model.gradient_checkpointing"),
    (["model=tiny_moe", "rollout.routing_replay=true", "rollout.record_routes=true"], "rollout.record_routes"),
    (["train.moe_aux_loss_coef=0.1"], "model.arch"),
    (["model.num_experts=8"], "model.num_experts"),  # a dense model: no effect
    (["model=tiny_moe", "model.num_experts_per_tok=5"], "model.num_experts_per_tok"),
    (["train.mismatch_gate_bound=0.1"], "train.mismatch_gate_bound"),  # gate off: no effect
    (["train.mismatch_gate=stop", "algorithm.use_rollout_logprobs=true"], "algorithm.use_rollout_logprobs"),
    (["train.mismatch_gate=halt"], "train.mismatch_gate"),
])
def test_bad_moe_and_gate_options_are_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert any(field in v.fields for v in err.value.violations), str(err.value)


def test_megatron_and_sglang_take_moe_models_with_replay():
    """model=tiny_moe on train.backend=megatron, replaying or recording routes, and over rollout=sglang with the
    embedded servers, validates (tests/megatron and tests/sglang check what they then do)."""
    for option in ("rollout.routing_replay=true", "rollout.record_routes=true"):
        cfg = load_config(["model=tiny_moe", "train.backend=megatron", option])
        assert cfg.train.backend == "megatron" and cfg.model.arch == "qwen3_moe"
    # the load-balancing loss too (tests/megatron/test_megatron_moe_aux_loss.py checks it against the torch backend's)
    cfg = load_config(["model=tiny_moe", "train.backend=megatron", "rollout.routing_replay=true",
                       "train.moe_aux_loss_coef=0.01", "train.moe_z_loss_coef=0.001"])
    assert cfg.train.moe_aux_loss_coef == 0.01
    cfg = load_config(["model=tiny_moe", "rollout=sglang", "rollout.sglang.server=embedded",
                       "rollout.routing_replay=true"])  # single-turn over SGLang's protocol (tests/sglang)
    assert cfg.rollout.backend == "sglang"
