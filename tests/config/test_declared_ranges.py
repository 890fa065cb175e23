"""Ranges declared on the schema's fields (`positive`, `non_negative`, `in_range`, `finite`): validation checks each
one, and the rules that the Megatron policy also checks are stated once (`relax.config.megatron_rules`)."""

from __future__ import annotations

import dataclasses

import pytest

from relax.algorithms.base import AlgorithmConfig, Range, range_of
from relax.algorithms.reinforce_pp import ReinforcePPConfig
from relax.config.megatron_rules import sequence_parallel_violation
from relax.config.schema import ModelConfig, RelaxConfig, RolloutConfig, TrainConfig
from relax.config.validate import validate


def messages(cfg: RelaxConfig, key: str) -> list[str]:
    return [v.message for v in validate(cfg) if key in v.fields]


@pytest.mark.parametrize("allowed,value,message", [
    (Range(0, lo_open=True), 0, "k=0 must be > 0"),
    (Range(0), -1, "k=-1 must be >= 0"),
    (Range(1), 0, "k=0 must be >= 1"),
    (Range(0, 1, lo_open=True), 1.5, "k=1.5 must be in (0, 1]"),
    (Range(0, 1, hi_open=True), 1, "k=1 must be in [0, 1)"),
    (Range(finite=True), float("nan"), "k=nan must be a finite number"),
])
def test_a_range_states_its_bounds(allowed: Range, value: float, message: str):
    assert not allowed.admits(value)
    assert allowed.message("k", value) == message


def test_a_sentinel_and_none_pass_only_where_declared():
    top_k = range_of(RolloutConfig, "top_k")
    assert top_k.admits(-1) and top_k.admits(5) and not top_k.admits(0)
    assert range_of(TrainConfig, "max_staleness").admits(None)
    assert not range_of(TrainConfig, "global_batch_size").admits(None)  # derived before validation: never None


def test_a_subclass_that_changes_a_default_keeps_the_declared_range():
    assert range_of(ReinforcePPConfig, "kl_coef") == range_of(AlgorithmConfig, "kl_coef")
    cfg = RelaxConfig(algorithm=ReinforcePPConfig(kl_coef=-0.1))
    assert "algorithm.kl_coef=-0.1 must be >= 0" in messages(cfg, "algorithm.kl_coef")


@pytest.mark.parametrize("section,key,value,message", [
    ("rollout", "top_p", 0.0, "rollout.top_p=0.0 must be in (0, 1]"),
    ("rollout", "top_k", 0, "rollout.top_k=0 must be -1 (off) or > 0"),
    ("train", "adam_beta2", 1.0, "train.adam_beta2=1.0 must be in [0, 1)"),
    ("tracking", "system_metrics_interval_s", float("inf"),
     "tracking.system_metrics_interval_s=inf must be a number of seconds > 0"),
])
def test_validation_reports_a_declared_range_in_its_words(section: str, key: str, value: float, message: str):
    cfg = RelaxConfig()
    cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})
    assert message in messages(cfg, f"{section}.{key}")


def test_a_conditional_range_is_checked_only_under_its_condition():
    assert "model.hidden_size=0 must be > 0" in messages(RelaxConfig(model=ModelConfig(hidden_size=0)),
                                                          "model.hidden_size")
    hf = RelaxConfig(model=ModelConfig(source="hf", hidden_size=0))
    assert not any("must be > 0" in m for m in messages(hf, "model.hidden_size"))
    assert messages(RelaxConfig(rollout=RolloutConfig(max_filter_rounds=0)), "rollout.max_filter_rounds") == [
        "rollout.max_filter_rounds=0 has no effect without rollout.filter_groups=true"]
    assert messages(dataclasses.replace(RelaxConfig(), seed=-1), "seed") == ["seed=-1 must be >= 0"]


def test_sequence_parallel_has_one_statement_for_validation_and_the_policy():
    assert sequence_parallel_violation("megatron", True, 2) is None
    assert sequence_parallel_violation("torch", False, 1) is None
    policy = sequence_parallel_violation("megatron", True, 1)  # what MegatronPolicy raises with TP=1
    assert policy is not None and policy.message in messages(
        RelaxConfig(train=TrainConfig(backend="megatron", sequence_parallel=True)), "train.sequence_parallel")
    torch = sequence_parallel_violation("torch", True, 1)
    assert torch is not None and torch.message in messages(
        RelaxConfig(train=TrainConfig(sequence_parallel=True)), "train.sequence_parallel")
