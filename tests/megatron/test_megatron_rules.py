"""`relax.config.megatron_rules.megatron_violations`: a pure function of the config (runs without megatron)."""

from __future__ import annotations

import dataclasses

import pytest

from relax.algorithms.grpo import GRPOConfig
from relax.algorithms.m2po import M2POConfig
from relax.config import megatron_rules
from relax.config.megatron_rules import megatron_violations
from relax.config.schema import ModelConfig, RelaxConfig, TrainConfig


def cfg(algorithm=None, model: dict | None = None, **train) -> RelaxConfig:
    return RelaxConfig(algorithm=algorithm or GRPOConfig(), model=ModelConfig(**(model or {})),
                       train=TrainConfig(backend="megatron", **train))


def fields(violations) -> set[str]:
    return {f for v in violations for f in v.fields}


@pytest.fixture(autouse=True)
def installed(monkeypatch):
    monkeypatch.setattr(megatron_rules, "megatron_installed", lambda: True)


def test_torch_backend_has_no_megatron_rules():
    assert megatron_violations(RelaxConfig(train=TrainConfig(tensor_parallel_size=3))) == []


def test_default_megatron_config_is_valid():
    assert megatron_violations(cfg(tensor_parallel_size=2)) == []


def test_tensor_parallel_must_divide_heads_and_kv_heads():
    v = megatron_violations(cfg(model=dict(num_attention_heads=4, num_key_value_heads=2), tensor_parallel_size=4))
    assert "train.tensor_parallel_size" in fields(v)
    assert "num_key_value_heads=2" in v[0].message


def test_pipeline_parallel_must_divide_layers():
    v = megatron_violations(cfg(model=dict(num_layers=3), pipeline_parallel_size=2))
    assert fields(v) == {"train.pipeline_parallel_size", "model.num_layers"}


def test_hf_models_are_checked_by_the_backend_not_here():
    assert megatron_violations(cfg(model=dict(source="hf", num_layers=3), pipeline_parallel_size=2)) == []


def test_context_parallel_rejected_with_reason_and_m2po_names_itself():
    v = megatron_violations(cfg(context_parallel_size=2))
    assert any("Transformer Engine" in x.message for x in v)
    from relax.config.validate import validate  # M2PO's own rule comes from its capability flags

    found = validate(cfg(algorithm=M2POConfig(), context_parallel_size=2))
    assert any(x.message.startswith("algorithm=m2po") and "context_parallel_size" in x.message for x in found)
    found = validate(cfg(dynamic_context_parallel=True))
    assert any("train.dynamic_context_parallel" in x.fields for x in found)


def test_sequence_parallel_needs_tensor_parallelism_and_the_megatron_backend():
    assert megatron_violations(cfg(tensor_parallel_size=2, sequence_parallel=True)) == []
    v = megatron_violations(cfg(sequence_parallel=True))
    assert fields(v) == {"train.sequence_parallel", "train.tensor_parallel_size"}
    from relax.config.validate import validate

    found = validate(RelaxConfig(train=TrainConfig(sequence_parallel=True, layer_spec="local")))
    assert {"train.sequence_parallel", "train.layer_spec"} <= fields(found)
    assert any("needs train.backend=megatron" in x.message for x in found if "train.layer_spec" in x.fields)


def test_transformer_engine_layers_need_gpus():
    from relax.config.validate import validate

    found = validate(cfg(layer_spec="transformer_engine"))
    assert any(x.fields == ("train.layer_spec", "cluster.actor_gpus") for x in found)
    assert not any("train.layer_spec" in x.fields for x in validate(cfg(layer_spec="local")))


def test_unsupported_architecture():
    v = megatron_violations(cfg(model=dict(arch="qwen3_5")))
    assert fields(v) == {"model.arch"} and "qwen3_5" in v[0].message


def test_missing_megatron_core_says_how_to_install(monkeypatch):
    monkeypatch.setattr(megatron_rules, "megatron_installed", lambda: False)
    v = megatron_violations(cfg())
    assert fields(v) == {"train.backend"} and "pip install -e '.[megatron]'" in v[0].message


def test_installed_lookup_does_not_import(monkeypatch):
    monkeypatch.undo()
    assert isinstance(megatron_rules.megatron_installed(), bool)
    assert dataclasses.is_dataclass(cfg())


def test_a_model_from_files_is_checked_before_ray_starts(tmp_path):
    """`model.source=hf` with an architecture the converter does not know: a clear error from the driver, before
    any process starts (its config.json is read, nothing else)."""
    import json

    from relax.config import load_config
    from relax.runner.errors import RunError
    from relax.runner.train import prepare

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_size": 64,
                                                      "num_attention_heads": 4, "num_hidden_layers": 2}))
    cfg = load_config(["train.backend=megatron", "model.source=hf", f"model.path={tmp_path}"])
    with pytest.raises(RunError, match="architecture 'mistral' is not supported by train.backend=megatron"):
        prepare(cfg)


@pytest.mark.slow
def test_the_cpu_default_real_model_is_supported():
    from relax.config import load_config
    from relax.data.tokenizer import resolve_model_path
    from relax.runner.train import _check_megatron_model

    cfg = load_config(["model=smollm2_135m", "train.backend=megatron", "train.tensor_parallel_size=3"])
    _check_megatron_model(cfg, resolve_model_path(cfg.model))  # llama layout, 9 heads / 3 kv heads: tp=3 fits


def test_moe_models_on_megatron_spread_experts_and_are_rejected_where_not_built():
    """train.expert_parallel_size: only on Megatron, only for an MoE model, dividing its experts and the trainer's
    ranks; MoE models at TP = PP = 1 (the load-balancing loss and the router z-loss are built). A valid one: none."""
    moe = dict(arch="qwen3_moe")
    assert megatron_violations(cfg(model=moe)) == []
    torch_ep = megatron_violations(RelaxConfig(train=TrainConfig(expert_parallel_size=2)))
    assert fields(torch_ep) == {"train.expert_parallel_size", "train.backend"}
    assert "model.arch" in fields(megatron_violations(cfg(expert_parallel_size=2)))  # a dense model
    assert "model.num_experts" in fields(megatron_violations(cfg(model=moe, expert_parallel_size=3)))
    assert "cluster.actor_gpus" in fields(megatron_violations(cfg(model=moe, expert_parallel_size=2)))  # 1 rank
    assert "train.tensor_parallel_size" in fields(megatron_violations(cfg(model=moe, tensor_parallel_size=2)))
    assert "train.pipeline_parallel_size" in fields(megatron_violations(cfg(model=moe, pipeline_parallel_size=2)))
    assert megatron_violations(cfg(model=moe, moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)) == []
