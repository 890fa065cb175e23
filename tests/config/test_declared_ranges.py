"""Ranges declared on the schema's fields (`positive`, `non_negative`, `in_range`, `finite`): validation checks each
one, and the rules that the Megatron policy also checks are stated once (`relax.config.megatron_rules`)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from relax import algorithms
from relax.algorithms.base import AlgorithmConfig, Range, range_of
from relax.algorithms.reinforce_pp import ReinforcePPConfig
from relax.config import ConfigError, load_config
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


@dataclasses.dataclass(frozen=True)
class _NewDefault(AlgorithmConfig):
    kl_coef: float = 0.5  # a new default alone


def test_a_subclass_that_changes_a_default_keeps_the_declared_range():
    assert range_of(_NewDefault, "kl_coef") == range_of(AlgorithmConfig, "kl_coef")
    assert not range_of(_NewDefault, "kl_coef").admits(-0.1)


def test_a_subclass_that_declares_its_own_range_is_checked_by_it():
    assert range_of(ReinforcePPConfig, "kl_coef") != range_of(AlgorithmConfig, "kl_coef")
    cfg = RelaxConfig(algorithm=ReinforcePPConfig(kl_coef=0.0))  # the base's range admits 0; REINFORCE++'s does not
    (message,) = messages(cfg, "algorithm.kl_coef")
    assert message.startswith("algorithm.kl_coef=0.0 must be a finite number > 0: REINFORCE++ puts its KL penalty")


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


# every size of a source=config model's architecture: one <= 0 builds zero-element (or negative-size) layers and
# failed only after Ray started (load_weights' shape check); it is refused before start, all of them at once
_ARCH_SIZES = ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "max_position_embeddings")


@pytest.mark.parametrize("value", [0, -5])
def test_every_architecture_size_must_be_positive_all_reported_at_once(value: int):
    cfg = RelaxConfig(model=ModelConfig(**{k: value for k in _ARCH_SIZES}))
    found = [v.message for v in validate(cfg)]
    for key in _ARCH_SIZES:
        assert f"model.{key}={value} must be > 0" in found, key
    with pytest.raises(ConfigError, match="model.intermediate_size=0 must be > 0"):
        load_config(["model.intermediate_size=0"])
    # model.source=hf reads its architecture from its files: the field is refused as having no effect, not as a size
    hf = RelaxConfig(model=ModelConfig(source="hf", intermediate_size=value))
    assert not any("must be > 0" in m for m in messages(hf, "model.intermediate_size"))


def test_sequence_parallel_has_one_statement_for_validation_and_the_policy():
    assert sequence_parallel_violation("megatron", True, 2) is None
    assert sequence_parallel_violation("torch", False, 1) is None
    policy = sequence_parallel_violation("megatron", True, 1)  # what MegatronPolicy raises with TP=1
    assert policy is not None and policy.message in messages(
        RelaxConfig(train=TrainConfig(backend="megatron", sequence_parallel=True)), "train.sequence_parallel")
    torch = sequence_parallel_violation("torch", True, 1)
    assert torch is not None and torch.message in messages(
        RelaxConfig(train=TrainConfig(sequence_parallel=True)), "train.sequence_parallel")


def config_classes(section: object):
    """The config dataclasses of `section` (an instance) and of the sections nested in it (rollout.sglang)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield type(value)
            yield from config_classes(value)


def float_fields_with_a_range():
    """(class, field) of every float field that declares a range: the schema's sections, nested ones included, and
    every algorithm's config class (seed is an int)."""
    classes = list(config_classes(RelaxConfig()))
    classes += [algorithms.get(name).config_cls for name in algorithms.names()]
    seen = set()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            allowed = range_of(cls, f.name)
            if allowed is not None and float in (hints[f.name], *typing.get_args(hints[f.name])):
                if (allowed, f.name) not in seen:
                    seen.add((allowed, f.name))
                    yield cls, f.name


@pytest.mark.parametrize("cls,name", list(float_fields_with_a_range()),
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_no_declared_float_range_admits_a_non_finite_value(cls, name):
    # one decision for every `positive` / `non_negative` field (relax.algorithms.base.positive): nan failed the
    # comparison already, +inf passed `> 0` although no field reads it as a setting (a timeout of inf overflows the
    # socket's, a coefficient of inf makes the loss NaN)
    allowed = range_of(cls, name)
    assert not allowed.admits(math.inf) and not allowed.admits(-math.inf) and not allowed.admits(math.nan)
    if allowed.hi is None and not allowed.says:  # a bounded range's message rules inf out: "must be in (0, 1]"
        assert "must be a finite number" in allowed.message(name, math.inf)


@pytest.mark.parametrize("overrides,key", [
    (["train.lr=inf"], "train.lr"),
    (["rollout.temperature=inf"], "rollout.temperature"),
    (["algorithm.eps_clip=inf"], "algorithm.eps_clip"),
    (["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=inf"], "algorithm.kl_loss_coef"),
    (["algorithm.entropy_coef=inf"], "algorithm.entropy_coef"),
    (["data.reward_timeout_s=inf"], "data.reward_timeout_s"),
    (["algorithm=sapo", "algorithm.tau_neg=inf"], "algorithm.tau_neg"),
    (["algorithm=sapo", "algorithm.tau_pos=nan"], "algorithm.tau_pos"),
])
def test_a_non_finite_value_is_rejected_before_start_naming_the_field(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    found = [v.message for v in err.value.violations if key in v.fields]
    assert any("must be a finite number" in m for m in found), str(err.value)


@pytest.mark.parametrize("value", ["0.5", "0.999", "inf"])
def test_tis_clip_below_one_is_rejected_before_start(value):
    # min(ratio, tis_clip) with tis_clip < 1 caps every on-policy token (ratio 1) at tis_clip: a smaller loss, not a
    # truncation of the rare large ratios
    with pytest.raises(ConfigError) as err:
        load_config(["algorithm.use_tis=true", f"algorithm.tis_clip={value}"])
    found = [v.message for v in err.value.violations if "algorithm.tis_clip" in v.fields]
    assert found == [f"algorithm.tis_clip={float(value)} must be a finite number >= 1: it caps the importance weight "
                     "min(ratio, tis_clip) from above, and a cap below 1 would scale down every token on which the "
                     "rollout engine and the trainer agree (ratio 1), a smaller loss rather than a truncation"]


@pytest.mark.parametrize("value", [1, 1.0, 2.0, 10])
def test_tis_clip_of_one_and_above_is_accepted(value):
    cfg = load_config(["algorithm.use_tis=true", f"algorithm.tis_clip={value}"])
    assert cfg.algorithm.tis_clip == value
