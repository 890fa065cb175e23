"""What evaluation runs, read from a config: the default eval set's name, the files of `data.eval_sets` with their
record keys, the k of pass@k and whether each eval sample is written (docs/training.md, "Evaluation"). Validation,
the datasets and the runner all read them through these functions."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Optional

# An eval set's name is one segment of its metric names (eval/<name>/pass_at_1): no "/", nothing MLflow refuses.
EVAL_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# tasks with an eval split of their own
EVAL_SET_TASKS = ("digits", "arithmetic", "guess_number", "calculator", "gsm8k")
# the keys of a `data.eval_sets` entry given as a mapping ({path: ..., prompt_key: ..., label_key: ...})
EVAL_SET_KEYS = ("path", "prompt_key", "label_key")


@dataclass(frozen=True)
class EvalSetFile:
    """One file of `data.eval_sets`: its path and the keys of its records' prompt and label, each the entry's own
    (`{path: ..., prompt_key: problem}`) or else `data.prompt_key` / `data.label_key`; `own`: which keys the entry
    named itself (error messages name the field to set)."""

    path: str
    prompt_key: str
    label_key: str
    own: tuple[str, ...] = ()


def eval_set_files(data: Any) -> dict[str, EvalSetFile]:
    """`data.eval_sets` by name, each entry read: `name: path`, or `name: {path, prompt_key, label_key}` (the keys
    but `path` optional). Assumes validation passed (`eval_set_problem` is None for each entry)."""
    out: dict[str, EvalSetFile] = {}
    for name, entry in data.eval_sets.items():
        if isinstance(entry, Mapping):
            own = tuple(k for k in ("prompt_key", "label_key") if entry.get(k) is not None)
            out[name] = EvalSetFile(str(entry["path"]), str(entry.get("prompt_key") or data.prompt_key),
                                    str(entry.get("label_key") or data.label_key), own)
        else:
            out[name] = EvalSetFile(str(entry), data.prompt_key, data.label_key)
    return out


def eval_set_problem(name: str, entry: Any) -> Optional[str]:
    """What is wrong with the `data.eval_sets` entry `name: entry`, or None: a path (a non-empty string), or a
    mapping with a non-empty string `path` and optionally a non-empty string `prompt_key` / `label_key`."""
    form = ("must be the path of a JSONL or Parquet file, or {path: <file>, prompt_key: <key>, label_key: <key>} "
            "(the keys optional)")
    if isinstance(entry, str):
        return None if entry.strip() else f"data.eval_sets.{name}={entry!r} {form}"
    if not isinstance(entry, Mapping):
        return f"data.eval_sets.{name}={entry!r} {form}"
    unknown = sorted(str(k) for k in entry if k not in EVAL_SET_KEYS)
    if unknown:
        return f"data.eval_sets.{name}: unknown key(s) {', '.join(unknown)}: an entry holds {', '.join(EVAL_SET_KEYS)}"
    bad = [k for k in EVAL_SET_KEYS if k in entry and (k == "path" or entry[k] is not None)
           and not (isinstance(entry[k], str) and entry[k].strip())]
    if "path" not in entry or entry["path"] is None:
        return f"data.eval_sets.{name} has no path: {form}"
    if bad:
        return f"data.eval_sets.{name}.{bad[0]}={entry[bad[0]]!r} must be a non-empty string"
    return None


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


def saves_eval_samples(cfg: Any) -> bool:
    """Whether each evaluation writes its samples (eval/<set>/step_<k>.jsonl): `train.eval_save_samples`, else (None)
    true for an evaluation-only run (`train.num_rollout=0`) and false for a training run."""
    if cfg.train.eval_save_samples is not None:
        return bool(cfg.train.eval_save_samples)
    return cfg.train.num_rollout == 0
