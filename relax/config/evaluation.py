"""What evaluation runs, read from a config: the default eval set's name and the k of pass@k (docs/training.md,
"Evaluation"). Validation, the datasets and the runner all read them through these functions."""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any, Optional

# An eval set's name is one segment of its metric names (eval/<name>/pass_at_1): no "/", nothing MLflow refuses.
EVAL_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# tasks with an eval split of their own
EVAL_SET_TASKS = ("digits", "arithmetic", "guess_number", "calculator", "gsm8k")


def file_eval_set_name(path: str) -> str:
    """The name of the eval set read from `path`: the file's stem (`/data/math500.jsonl` -> `math500`)."""
    return PurePath(path).stem


def default_eval_set_name(data: Any) -> Optional[str]:
    """The name of the eval set of `data.eval_path` (its stem) or of the task's eval split (the task's name:
    digits, arithmetic, gsm8k); None when there is neither (data.task=file without data.eval_path)."""
    if data.eval_path is not None:
        return file_eval_set_name(data.eval_path)
    if data.path is None and data.task in EVAL_SET_TASKS:
        return data.task
    return None


def evaluates(cfg: Any) -> bool:
    """Whether the run evaluates at all: `train.eval_interval > 0`, or `train.num_rollout=0` (an evaluation-only run,
    which evaluates its starting weights once whatever the interval)."""
    return cfg.train.eval_interval > 0 or cfg.train.num_rollout == 0


def eval_pass_ks(cfg: Any) -> list[int]:
    """The k of the logged pass@k: `train.eval_pass_k`, else [1, n] (just [1] when n = 1), n =
    `rollout.eval_n_samples_per_prompt`."""
    if cfg.train.eval_pass_k is not None:
        return list(cfg.train.eval_pass_k)
    n = cfg.rollout.eval_n_samples_per_prompt
    return sorted({1, n})
