"""A `model.source=hf` directory whose model_type Relax cannot load is refused by validation (so by dry_run, before
Ray, and by relax-serve) naming the model type and what is supported, instead of passing as a text-only model and
ending the run when its actor loads it (Qwen3-VL-MoE did, before Relax built it; GLM-4.5V now stands for such a
model). The expectation is transformers' own: a model_type is loadable
when AutoModelForCausalLM builds a model from its config (on the meta device: no memory), or when it is one of the
vision-language types Relax builds itself."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from relax.config import ConfigError, load_config
from relax.config.vision_rules import VISION_MODEL_TYPES

TYPES = ["qwen3_vl_moe", "glm4v_moe", "qwen3", "qwen3_moe", "llama", "qwen2_5_vl", "qwen3_vl", "t5", "clip"]


def _causal_lm_builds(model_type: str) -> bool:
    config = AutoConfig.for_model(model_type)
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except ValueError:  # "Unrecognized configuration class ... for this kind of AutoModel: AutoModelForCausalLM"
        return False
    return True


def _directory(tmp_path, model_type: str):
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps(AutoConfig.for_model(model_type).to_dict()))
    return path


@pytest.mark.parametrize("model_type", TYPES)
def test_validation_refuses_exactly_the_model_types_relax_cannot_load(tmp_path, model_type):
    loadable = model_type in VISION_MODEL_TYPES or _causal_lm_builds(model_type)
    path = _directory(tmp_path, model_type)
    overrides = ["model.source=hf", "model.name=m", f"model.path={path}"]
    if loadable:
        cfg = load_config(overrides)
        assert cfg.model.path == str(path)
        return
    with pytest.raises(ConfigError) as exc:
        load_config(overrides)
    messages = [v.message for v in exc.value.violations]
    assert len(messages) == 1, messages
    assert f"model.path={path}: model_type {model_type!r}" in messages[0]
    assert "qwen2_5_vl or qwen3_vl" in messages[0] and "AutoModelForCausalLM" in messages[0]


def test_an_unsupported_vision_language_model_is_named_so_not_a_text_one(tmp_path):
    """The review's case (then Qwen3-VL-MoE, now built: tests/models/test_vl_moe.py): with an image task it was
    refused as 'a text-only model'; now as unsupported, by name."""
    path = _directory(tmp_path, "glm4v_moe")
    assert not _causal_lm_builds("glm4v_moe")  # what the actor would hit
    with pytest.raises(ConfigError) as exc:
        load_config(["model.source=hf", "model.name=m", f"model.path={path}", "data=shapes"])
    (message,) = [v.message for v in exc.value.violations]
    assert "'glm4v_moe'" in message and "vision-language model Relax does not support yet" in message
    assert "text-only" not in message


def test_a_teacher_of_an_unsupported_type_is_refused(tmp_path):
    path = _directory(tmp_path, "glm4v_moe")
    with pytest.raises(ConfigError) as exc:
        load_config(["algorithm=opd", "teacher.source=hf", f"teacher.path={path}"])
    assert any(f"teacher.path={path}: model_type 'glm4v_moe'" in v.message for v in exc.value.violations)
