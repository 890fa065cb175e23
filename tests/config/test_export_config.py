"""The rules of `train.save_hf` and `tracking.log_model` (docs/training.md, "Exporting a checkpoint to Hugging Face"):
what they need is checked before start, every problem at once; they may change when a run is resumed."""

from __future__ import annotations

import pytest

from relax.config import ConfigError, load_config
from relax.runner.checkpoint import config_differences
from relax.tracking.params import flatten_config


def violations(*overrides: str) -> dict[tuple[str, ...], str]:
    with pytest.raises(ConfigError) as err:
        load_config(list(overrides))
    return {v.fields: v.message for v in err.value.violations}


def test_save_hf_is_accepted_on_both_backends():
    assert load_config(["train.save_hf=true"]).train.save_hf
    assert load_config(["train.backend=megatron", "train.save_hf=true"]).train.save_hf


def test_save_hf_without_checkpoints_is_rejected():
    found = violations("train.save=false", "train.save_hf=true")
    assert found == {("train.save_hf",): "train.save_hf=True has no effect: train.save=false writes no checkpoint"}


def test_log_model_needs_save_hf():
    found = violations("tracking.log_model=true")
    assert found == {("tracking.log_model", "train.save_hf"): (
        "tracking.log_model=true logs the Hugging Face directory that train.save_hf=true exports at the end of the "
        "run: set train.save_hf=true too")}
    assert load_config(["train.save_hf=true", "tracking.log_model=true"]).tracking.log_model


def test_log_model_needs_tracking_and_every_problem_is_reported_at_once():
    found = violations("tracking.log_model=true", "tracking.enabled=false", "train.save=false", "train.save_hf=true")
    assert set(found) == {("tracking.log_model", "tracking.enabled"), ("train.save_hf",)}
    assert "tracking.enabled=false" in found[("tracking.log_model", "tracking.enabled")]
    found = violations("tracking.log_model=true", "tracking.enabled=false")
    assert set(found) == {("tracking.log_model", "tracking.enabled"), ("tracking.log_model", "train.save_hf")}


def test_a_resume_may_turn_the_export_and_the_model_on():
    """They act at the end of the run, not on what a step computes: a run can be continued (or a finished one
    resumed) to export its final checkpoint."""
    before = flatten_config(load_config([]))
    after = flatten_config(load_config(["train.save_hf=true", "tracking.log_model=true"]))
    refused, allowed = config_differences(before, after)
    assert refused == {} and set(allowed) == {"train.save_hf", "tracking.log_model"}
