"""Everything computed from a config rather than set in it, in one place: `resolve` fills the fields whose default
is None ("derived") when the config is built, and the functions below derive what the planner, the trainers and
the rules read (`data_parallel_size`, `actor_world_size`, `needs_reference`, `teacher_model`,
`total_optimizer_steps`). After `resolve`, no field the runner reads is None.
"""

from __future__ import annotations

import dataclasses
import json
import string
from pathlib import Path
from typing import Any

from relax import algorithms
from relax.config.schema import ModelConfig, RelaxConfig, TrainConfig


def resolve(cfg: RelaxConfig) -> RelaxConfig:
    """Fill the fields whose default is None ("derived") from the algorithm and the batch sizes."""
    algo = algorithms.get(cfg.algorithm.name)
    t, ro = cfg.train, cfg.rollout
    samples = ro.rollout_batch_size * ro.n_samples_per_prompt
    steps, gbs = t.num_steps_per_rollout, t.global_batch_size
    if gbs is None:
        steps = 1 if steps is None else steps
        gbs = max(1, samples // steps) if steps and steps > 0 else samples
    elif steps is None:
        steps = max(1, samples // gbs) if gbs > 0 else 1
    per_token = algo.per_token_loss if t.calculate_per_token_loss is None else t.calculate_per_token_loss
    staleness = t.max_staleness if t.max_staleness is not None else (0 if t.mode == "sync" else 1)
    train = dataclasses.replace(t, global_batch_size=gbs, num_steps_per_rollout=steps,
                                calculate_per_token_loss=per_token, max_staleness=staleness)
    # dynamic sampling's generation rounds draw rollout_batch_size prompts unless told otherwise (no rounds: None)
    over = ro.over_sampling_batch_size
    if over is None and ro.filter_groups:
        over = ro.rollout_batch_size
    episode = ro.max_episode_tokens
    if episode is None:
        episode = ro.max_response_len if not agentic(cfg) else 2 * ro.max_turns * ro.max_response_len
    stage = ro.stage_weights
    if stage is None:  # weights staged beside generation where the copy does not take the generation's cores
        stage = t.mode != "sync" and ro.backend == "embedded" and cfg.cluster.num_nodes * cfg.cluster.gpus_per_node > 0
    rollout = dataclasses.replace(ro, over_sampling_batch_size=over, max_episode_tokens=episode, stage_weights=stage)
    if ro.backend == "sglang" and ro.sglang.weight_sync is None:
        # colocated: tensor (shared memory on one CPU node; on GPUs, CUDA IPC from the actor rank on each server's
        # GPU, whatever the nodes: a weight-update group would hold two ranks on one GPU, which NCCL refuses);
        # otherwise a weight-update group (distributed)
        c = cfg.cluster
        sync = "tensor" if c.colocate and (c.num_nodes == 1 or c.gpus_per_node > 0) else "distributed"
        rollout = dataclasses.replace(rollout, sglang=dataclasses.replace(ro.sglang, weight_sync=sync))
    return dataclasses.replace(cfg, train=train, rollout=rollout, model=adapter_model_config(cfg.model))


# model.lora_* -> the key of adapter_config.json that holds it (PEFT's LoraConfig)
ADAPTER_KEYS = {"lora_rank": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
                "lora_target_modules": "target_modules"}


def adapter_lora_settings(adapter_dir: str) -> dict[str, Any] | None:
    """`model.lora_adapter_path`'s adapter_config.json as model.lora_* values (lora_rank, lora_alpha, lora_dropout,
    lora_target_modules: a list of names, sorted; "all-linear" as [all-linear]); None where the file cannot be read
    or a value is not of its kind (the `lora` check refuses the directory before start, naming what is wrong:
    `relax.models.lora.check_adapter_dir`)."""
    try:
        own = json.loads((Path(adapter_dir).expanduser() / "adapter_config.json").read_bytes())
        targets = own["target_modules"]
        targets = [targets] if targets == "all-linear" else sorted(targets) if isinstance(targets, list) else None
        values = {"lora_rank": int(own["r"]), "lora_alpha": float(own["lora_alpha"]),
                  "lora_dropout": float(own.get("lora_dropout") or 0.0), "lora_target_modules": targets}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if targets is None or not all(isinstance(t, str) for t in targets):
        return None  # a regular expression: refused by the lora check
    return values


def adapter_model_config(model: ModelConfig) -> ModelConfig:
    """With model.lora_adapter_path, the model.lora_* options left at their defaults take the adapter's own values
    (its adapter_config.json wins); one set to another value is left for validation to refuse, naming both
    (`adapter_conflicts`). Unreadable: unchanged (refused before start by the lora check)."""
    if not model.lora_adapter_path:
        return model
    own = adapter_lora_settings(model.lora_adapter_path)
    if own is None:
        return model
    default = ModelConfig()
    return dataclasses.replace(model, **{k: v for k, v in own.items() if getattr(model, k) == getattr(default, k)})


def adapter_conflicts(model: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(option, its value, the adapter's value) for each model.lora_* option of a resolved config that is not what
    model.lora_adapter_path's adapter_config.json says ([] without an adapter, or when it cannot be read)."""
    own = adapter_lora_settings(model.lora_adapter_path) if model.lora_adapter_path else None
    if own is None:
        return []
    return [(k, getattr(model, k), v) for k, v in own.items()
            if (sorted(getattr(model, k)) if k == "lora_target_modules" else getattr(model, k)) != v]


def agentic(cfg: RelaxConfig) -> bool:
    """Whether rollouts are episodes of turns (an environment, tools or an agent loop answers the model)."""
    d = cfg.data
    return bool(d.env or d.tools or d.agent or d.openai_agent)


def template_reads(template: str | None, field: str) -> bool:
    """Whether a judge's template names `{field}` (an unreadable one: its own rule reports it)."""
    try:
        return any(name == field for _, name, _, _ in string.Formatter().parse(template or ""))
    except ValueError:
        return False


def label_reader(cfg: RelaxConfig) -> str | None:
    """What of the run reads a prompt's label, as the missing-label message names it: `data.reward` (a function or
    a service is called with it; the eval sets are scored by it too) or a judge whose `reward_model.template` names
    {label}. None where nothing does (data.reward=none: an environment or agent loop gives the rewards, or a
    classifier or a judge without {label} scores): a record then needs no label, and its item's label is ""."""
    d, rm = cfg.data, cfg.reward_model
    if d.reward != "none":
        return f"data.reward={d.reward if isinstance(d.reward, str) else list(d.reward)}"
    if rm.kind == "judge" and template_reads(rm.template, "label"):
        return "reward_model.template's {label}"
    return None


def data_parallel_size(cfg: RelaxConfig) -> int:
    """Replicas of the actor's gradient: 1 for the torch backend (one device)."""
    if cfg.train.backend != "megatron":
        return 1
    model_parallel = cfg.train.tensor_parallel_size * cfg.train.pipeline_parallel_size * cfg.train.context_parallel_size
    return max(1, cfg.cluster.actor_gpus // max(1, model_parallel))


def actor_world_size(cfg: RelaxConfig) -> int:
    """Processes of the actor: 1 for the torch backend; tp x pp x cp x dp Megatron ranks (one per GPU, or on
    the CPU cores: tp x pp)."""
    if cfg.train.backend != "megatron":
        return 1
    t = cfg.train
    return t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size * data_parallel_size(cfg)


def needs_reference(cfg: RelaxConfig) -> str | None:
    """Why a reference model is needed, or None: only a KL term needs one (the plan starts it when this says so)."""
    a = cfg.algorithm
    if algorithms.get(a.name).requires_reference:
        return f"{a.name} requires it"
    if a.use_kl_loss:
        return f"KL loss ({a.kl_loss_type})"
    if a.kl_coef != 0:
        return "reward-side KL (kl_coef)"
    return None


def teacher_model(cfg: RelaxConfig) -> ModelConfig | None:
    """The teacher as a model config (what `relax.models.hf` and `relax.data.tokenizer` load), or None when
    the algorithm distills from none (the plan starts the teacher role when this returns one)."""
    if not algorithms.get(cfg.algorithm.name).requires_teacher:
        return None
    t = cfg.teacher
    return ModelConfig(name=t.name, source=t.source, path=t.path, base_path=t.base_path, dtype=t.dtype)


def total_optimizer_steps(train: TrainConfig) -> int:
    """Optimizer steps of a run, the horizon of cosine and linear lr schedules: num_rollout * num_steps_per_rollout
    (one step per rollout in a config built without `resolve`, as tests build trainers)."""
    return max(1, train.num_rollout * (train.num_steps_per_rollout or 1))
