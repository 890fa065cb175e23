"""The rules of vision-language runs (docs/training.md, "Vision-language"): which models take images, and what is
not built for them yet, rejected before anything starts with the reason (never accepted and ignored).

Layer 1 of 0-9: reads the config (and, for `model.source=hf`, the `model_type` of the directory's config.json).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from relax.algorithms.base import Violation
from relax.config.derive import teacher_model
from relax.config.evaluation import eval_set_problem, evaluates
from relax.config.schema import RelaxConfig

# model.arch values built by transformers' vision-language classes (source=config), and the model_type of a
# config.json that is one (source=hf)
VISION_ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
VISION_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
VL_MOE = "qwen3_vl_moe"  # the vision-language mixture of experts (arch and model_type): Qwen3-VL-MoE
VL_MOE_SGLANG_ROUTES = ("routed experts of a vision-language mixture-of-experts model (Qwen3-VL-MoE) over SGLang's "
                        "protocol are not built: how SGLang's answer lines up with the image tokens is not verified; "
                        "use rollout=embedded, whose engine records every token's experts, image tokens included")
IMAGE_TASKS = ("shapes", "grid_walk")  # synthetic tasks whose prompts hold images (relax.data.tasks)
NOT_BUILT = "is not built for vision-language models yet"


def hf_model_type(model_cfg: object) -> Optional[str]:
    """The model_type of a `source=hf` model's config.json (model.path, else $MODEL_DIR/<name>); None when there is
    none to read (the model's own checks report a missing directory)."""
    if getattr(model_cfg, "source", "config") != "hf":
        return None
    path = getattr(model_cfg, "path", None)
    if not path and os.environ.get("MODEL_DIR"):
        path = str(Path(os.environ["MODEL_DIR"]) / getattr(model_cfg, "name", ""))
    if not path:
        return None
    try:
        value = json.loads((Path(path).expanduser() / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def is_vision_model(model_cfg: object) -> bool:
    """Whether the policy model takes images: model.arch (source=config) or its config.json (source=hf)."""
    if getattr(model_cfg, "source", "config") == "config":
        return getattr(model_cfg, "arch", "qwen3") in VISION_ARCHS
    return hf_model_type(model_cfg) in VISION_MODEL_TYPES


def unsupported_model_type(model_cfg: object, key: str = "model") -> Optional[str]:
    """Why a `source=hf` model (`key`: its config group, model or teacher) cannot be loaded, or None: its config.json's
    model_type is neither a vision-language type Relax builds (VISION_MODEL_TYPES) nor one transformers'
    AutoModelForCausalLM loads (what every other source=hf model is loaded with). Such a model used to pass
    validation as a text-only one and end the run when its actor loaded it (Qwen3-VL-MoE: `Unrecognized
    configuration class Qwen3VLMoeConfig for ... AutoModelForCausalLM`)."""
    model_type = hf_model_type(model_cfg)
    if model_type is None or model_type in VISION_MODEL_TYPES:
        return None
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    where = f"{key}.path={getattr(model_cfg, 'path', None) or getattr(model_cfg, 'name', '')}"
    kind = ("a vision-language model Relax does not support yet"
            if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or "_vl" in model_type
            else "not a model transformers loads as a causal language model")
    return (f"{where}: model_type {model_type!r} (its config.json) is {kind}. A {key}.source=hf model is either a "
            f"vision-language model of model_type {' or '.join(VISION_MODEL_TYPES)} (Qwen2.5-VL, Qwen3-VL, "
            "Qwen3-VL-MoE; not Qwen3-Omni) or a text model transformers' AutoModelForCausalLM loads (model_type "
            "qwen3, qwen3_moe, llama, ...)")


def vision_violations(cfg: RelaxConfig) -> list[Violation]:
    """Every broken vision-language rule of `cfg`."""
    m, d, t = cfg.model, cfg.data, cfg.train
    found: list[Violation] = []

    def require(ok: bool, fields: tuple[str, ...], message: str) -> None:
        if not ok:
            found.append(Violation(fields, message))

    # a model that is neither a vision-language model Relax builds nor a causal LM: refused by name, before anything
    # starts (not taken for a text-only model)
    unsupported = unsupported_model_type(m)
    if unsupported:
        return [Violation(("model.path",), unsupported)]
    teacher = teacher_model(cfg)
    unsupported = None if teacher is None else unsupported_model_type(teacher, "teacher")
    require(unsupported is None, ("teacher.path",), unsupported or "")
    vision = is_vision_model(m)
    model = f"model={m.name} (model.arch={m.arch})" if m.source == "config" else f"model.path={m.path or m.name}"
    # a source=hf directory not there to read says nothing either way (its own check reports it before start)
    unknown = m.source == "hf" and hf_model_type(m) is None
    if not vision and not unknown:
        image_task = d.path is None and d.task in IMAGE_TASKS
        require(not image_task, ("data.task", "model.arch"),
                f"data.task={d.task} is an image task but {model} is a text-only model; use a vision-language "
                "model (model=tiny_vl, tiny_vl_moe, qwen2_5_vl_3b, qwen3_vl_2b)")
        require(not d.blank_images, ("data.blank_images", "model.arch"),
                f"data.blank_images=true has no effect: {model} is a text-only model and takes no images")
        require(d.image_key == "images", ("data.image_key", "model.arch"),
                f"data.image_key={d.image_key!r} has no effect: {model} is a text-only model and takes no images")
        require(m.freeze_vision_tower is None, ("model.freeze_vision_tower", "model.arch"),
                f"model.freeze_vision_tower={m.freeze_vision_tower} has no effect: {model} has no vision tower")
    if not vision:
        return found
    # a built-in image task builds its own images and reads no record column; only a data file would read
    # data.image_key: an eval set's file (data.eval_sets: a built-in task's data.eval_path is refused on its own), and
    # only where the run evaluates and the entry is one (an entry refused on its own, or one of a run that evaluates
    # nothing, reads no file, so it lets no data.image_key through)
    builtin = d.task if d.path is None and d.task in IMAGE_TASKS else None
    eval_files = evaluates(cfg) and any(eval_set_problem(n, e) is None for n, e in d.eval_sets.items())
    require(builtin is None or d.image_key == "images" or eval_files,
            ("data.image_key", "data.task"),
            f"data.image_key={d.image_key!r} has no effect: data.task={builtin} builds its own images and reads no "
            "record column (data.image_key names the image column of a data file: data.path or data.eval_sets); "
            "leave it unset")
    ro = cfg.rollout
    vl_moe = (m.arch if m.source == "config" else hf_model_type(m)) == VL_MOE
    routes = "rollout.routing_replay" if ro.routing_replay else "rollout.record_routes" if ro.record_routes else None
    require(not (vl_moe and routes and ro.backend == "sglang"), (str(routes), "rollout.backend"),
            f"{routes}=true with rollout=sglang: {VL_MOE_SGLANG_ROUTES}")
    require(t.backend != "megatron", ("train.backend", "model.arch"),
            f"train.backend=megatron {NOT_BUILT}: megatron-core's multimodal model is not wired to Relax's trainer; "
            "use train.backend=torch")
    # multi-turn episodes (data.env, data.tools, data.agent) run on both rollouts: over rollout=sglang every turn's
    # request carries the prompt's and the image observations' images so far (relax.rollout.sglang.episodes), and
    # a resumed episode (partial rollout) takes them from its interrupted row's vision inputs
    require(d.openai_agent is None, ("data.openai_agent",),
            f"data.openai_agent {NOT_BUILT}: the training gateway does not take image content parts yet")
    # a critic's values and a teacher's log-probs run the model's multimodal forward with the rows' images, as the
    # policy's (relax.train.torch_critic, relax.train.logprobs); a teacher must then take images too
    if teacher is not None and unsupported is None and not (teacher.source == "hf" and hf_model_type(teacher) is None):
        require(is_vision_model(teacher), ("teacher.path", "model.arch"),
                f"the distillation teacher (teacher.source={teacher.source}, "
                f"teacher.path={teacher.path or teacher.name}) is a text-only model: it would score the responses "
                f"without the prompts' images that {model} sees; use a vision-language teacher of the same family "
                "and tokenizer (a Hugging Face directory: train.save_hf or relax-export of a vision-language run)")
    require(not cfg.tracking.log_model, ("tracking.log_model", "model.arch"),
            f"tracking.log_model=true {NOT_BUILT}: MLflow's transformers flavor logs such a model as an "
            "image-text-to-text pipeline, which needs the family's whole processor (its video processor needs "
            "torchvision, which Relax does not install); train.save_hf=true alone exports the Hugging Face directory "
            "(model, processor, chat template)")
    require(m.source != "config" or m.tokenizer is None, ("model.tokenizer", "model.arch"),
            f"model.tokenizer with model.arch={m.arch}: the tiny vision-language model needs its own tokenizer (with "
            "the vision tokens); leave model.tokenizer unset")
    return found
