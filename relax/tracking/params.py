"""The resolved config as MLflow params, and the tags that let arms of an experiment be filtered.

Kept free of MLflow imports so that the CLI can flatten a config (dry runs, sweeps) without paying
MLflow's import time. The tag names below are the one place these names are spelled.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from relax import algorithms

# MLflow's limit on a param value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH in MLflow 3; a test
# checks that the two agree). Longer values are cut here, visibly, instead of failing the run start.
PARAM_VALUE_MAX_LEN = 6000
TRUNCATION_MARKER = "...[truncated]"

# Run tags written at every run start (see `standard_tags`). Sweep tags are added next to these.
TAG_ALGORITHM = "algorithm"
TAG_MODEL = "model"
TAG_SEED = "seed"
TAG_DATA = "data"
TAG_CLUSTER = "cluster"
TAG_ARM = "arm"
STANDARD_TAG_KEYS: tuple[str, ...] = (TAG_ALGORITHM, TAG_MODEL, TAG_SEED, TAG_DATA, TAG_CLUSTER, TAG_ARM)
# the teacher of a distillation run (teacher.name, or teacher.path without a named option); absent without a teacher
TAG_TEACHER = "teacher"
# Sweep tags: on a sweep's parent run and on each of its jobs' runs (see hydra_plugins/relax_ray_launcher).
TAG_SWEEP_ID = "sweep_id"
TAG_OVERRIDES = "overrides"  # the command-line overrides of the job (or the sweep's, on the parent run)
# Overrides the sweep launcher adds to every job; bookkeeping, so left out of the overrides tag.
LAUNCHER_OVERRIDE_KEYS: tuple[str, ...] = ("tracking.parent_run_id", "tracking.sweep_id", "tracking.arm")

# Config fields that may differ between a checkpoint and the run that continues it: they change how long the
# run goes on, where and how often it saves, what the terminal shows, or which cluster/sweep it runs in, but
# not what a step computes (except that num_rollout sets the length of a cosine/linear lr schedule). Any other
# difference makes a resume refuse (relax.runner.checkpoint.config_differences), and runs of one arm that differ
# elsewhere are not reruns of one config (relax.tracking.compare.config_conflicts). Here, below the runner, so that
# both read this one list.
RESUMABLE_CHANGES: tuple[str, ...] = (
    "train.resume",
    "train.num_rollout",
    "train.save",
    "train.save_interval",
    "train.save_dir",
    "train.keep_checkpoints",
    "train.save_hf",  # what the run writes besides its checkpoints: the final export, the MLflow model
    "tracking.log_model",
    "tracking.progress",
    "tracking.parent_run_id",
    "tracking.sweep_id",
    "cluster.address",
    "dry_run",
    # how faults are answered and what the machine reports: not what a step computes
    "train.max_restarts",
    "train.save_failures",
    "train.save_on_preempt",
    "train.checkpoint_timeout_s",
    "cluster.heartbeat_timeout_s",
    "tracking.system_metrics",
    "tracking.system_metrics_interval_s",
    # what evaluation runs and how (docs/training.md, "Evaluation"): only evaluation reads these; it samples its own
    # prompts with its own random streams between two rollout batches, so a training step computes the same with any
    # of them (but in fully_async with weight_sync_interval > 1, where the weights published before each evaluation
    # reach the rollouts that follow, `resume_point` refuses a new interval while steps are left)
    "train.eval_interval",
    "train.eval_pass_k",
    "train.eval_correct_threshold",
    "train.eval_save_samples",
    "rollout.eval_n_samples_per_prompt",
    "rollout.eval_temperature",
    "rollout.eval_top_p",
    "data.eval_path",
    "data.eval_sets",
    "data.num_eval_prompts",
)


def truncate_value(value: str, limit: int = PARAM_VALUE_MAX_LEN) -> str:
    """Cut `value` to `limit` characters, ending with a marker so that a reader sees it was cut."""
    if len(value) <= limit:
        return value
    return value[: max(0, limit - len(TRUNCATION_MARKER))] + TRUNCATION_MARKER


def _scalar_str(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    return str(value)  # None -> "None", floats in their shortest round-trip form


def _is_tree(value: Any) -> bool:
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)) or isinstance(value, Mapping)


def _children(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):
        return [(str(k), v) for k, v in value.items()]
    return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]


def flatten_config(cfg: Any, *, max_len: int = PARAM_VALUE_MAX_LEN) -> dict[str, str]:
    """Flatten a (frozen) dataclass tree or dict to `{"algorithm.eps_clip": "0.2", "seed": "1", ...}`.

    MLflow params are flat strings, and dotted keys are the same keys a user types as Hydra
    overrides, so a param can be copied back onto a command line. Lists of dataclasses/dicts get
    index keys (`x.0.a`); other lists become one string. An empty dataclass/dict keeps its key with
    value "{}" so that its presence is recorded. Values longer than MLflow's limit are truncated with
    `TRUNCATION_MARKER`.
    """
    out: dict[str, str] = {}

    def visit(prefix: str, value: Any) -> None:
        if _is_tree(value):
            children = _children(value)
            if not children and prefix:
                out[prefix] = "{}"
            for name, child in children:
                visit(f"{prefix}.{name}" if prefix else name, child)
        elif isinstance(value, (list, tuple)) and any(_is_tree(v) for v in value):
            for i, child in enumerate(value):
                visit(f"{prefix}.{i}" if prefix else str(i), child)
        else:
            if not prefix:
                raise TypeError(f"flatten_config expects a dataclass instance or a mapping, got {type(value).__name__}")
            if isinstance(value, (list, tuple)):
                text = str([v.value if isinstance(v, enum.Enum) else v for v in value])
            else:
                text = _scalar_str(value)
            out[prefix] = truncate_value(text, max_len)

    visit("", cfg)
    return out


def standard_tags(cfg: Any) -> dict[str, str]:
    """Tags that identify a run among its siblings: algorithm, model, seed, data, cluster, arm (and teacher, sweep_id).

    `arm` is `tracking.arm` when set, else the algorithm name, so that `relax-compare --by arm`
    works for runs that were not part of a sweep. `sweep_id` is present only for a sweep's jobs.
    `cfg` is a `RelaxConfig` (or anything shaped like it).
    """
    algorithm = str(cfg.algorithm.name)
    arm = cfg.tracking.arm
    tags = {
        TAG_ALGORITHM: algorithm,
        TAG_MODEL: str(cfg.model.name),
        TAG_SEED: str(cfg.seed),
        TAG_DATA: str(cfg.data.name),
        TAG_CLUSTER: str(cfg.cluster.name),
        TAG_ARM: str(arm) if arm else algorithm,
    }
    teacher = getattr(cfg, "teacher", None)
    if teacher is not None and algorithms.get(algorithm).requires_teacher:
        tags[TAG_TEACHER] = str(teacher.name if teacher.name != "none" else teacher.path)
    sweep_id = getattr(cfg.tracking, "sweep_id", None)
    if sweep_id:
        tags[TAG_SWEEP_ID] = str(sweep_id)
    return tags


def overrides_text(overrides: Sequence[str]) -> str:
    """A job's command-line overrides as one line for the `overrides` tag, without the launcher's bookkeeping."""
    keep = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in LAUNCHER_OVERRIDE_KEYS]
    return truncate_value(" ".join(keep), 5000)
