"""Checkpoints of a run: where they live, how they commit atomically, and which checkpoint a resume may continue.

Where: `train.save_dir`, else `<cwd>/checkpoints/<tracking.experiment>/<run name>` (see `default_save_dir`):
a stable place per experiment and run name, so that `train.resume=auto` finds it again from the same
directory without naming it. The run name is `tracking.run_name`, else `<arm>-seed<seed>` (the arm is
`tracking.arm`, else the algorithm name; a sweep's launcher sets the arm from the swept keys).

Layout of `<save_dir>/step_000040/`: `policy/` (HF format, safetensors, plus optimizer and scheduler state),
`critic/` (PPO), `config.yaml` (the resolved config, for people), `rollout.pt` (the rollout stream: batches
generated but not yet trained, the batch in flight with its partial responses, the next step to generate),
`ledger.jsonl` (the samples steps 0..39 trained, `relax.runner.ledger`, added through `Checkpoints.attachments`) and
`state.json`: the step, the sampler's position, the MLflow run id, the tracker's counters, the flattened config
(what a resume is checked against), the lineage (one id per run from its fresh start, kept across resumes),
the commit sequence number, what identifies the run's model files (`relax.runner.model_record`, which a resume
and relax-export check model.path against: `check_run_model`) and its prompt sets (`run_data`: the training set's
and each eval set's digest and size, as the MLflow dataset log records them; a resume checks the files against it:
`check_run_data`). Every sample draws from the random stream of (seed,
sample id, position), so no other RNG state is needed to resume exactly.

Commit: everything is written to `.tmp-step_NNNNNN/`, every file and directory is fsync'ed, the directory is
renamed to `step_NNNNNN/` and the parent fsync'ed; only then are older checkpoints removed (the newest
`train.keep_checkpoints` of the run are kept; a fresh run first moves the checkpoints of earlier runs in its
directory to `earlier/<lineage>/`, deleting nothing of theirs). A directory starting with "." is never a
checkpoint: a kill during a save leaves a `.tmp-` directory that resume ignores and the next run there deletes.
"Latest" is the most recently committed checkpoint (highest sequence number), not the highest step.

Integrity: state.json lists every other file of the checkpoint with its size and SHA-256 (`files`, computed at
commit, hashed in parallel: about 1.4 GB/s a core). A resume checks them all before any process starts and refuses a
missing, truncated, changed or added file with one message naming it; nothing is unpickled beyond tensors and plain
values (`weights_only=True`, safetensors, JSON), so a tampered checkpoint cannot run code. A checkpoint written
before manifests is checked by format instead (safetensors headers, weights-only torch files, JSON).

One run at a time per directory: the run holds an exclusive `flock` on `<save_dir>/.lock` (released by the
kernel when the process dies, `kill -9` included). On a filesystem without flock (ENOLCK, EOPNOTSUPP, ENOSYS) the
run goes on without it, with a warning (`_flock`). `<save_dir>/run.json` names the MLflow run of the last job
there, so that the next job can mark it KILLED if it was killed before its first checkpoint (see Session).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from relax.config.evaluation import default_eval_set_name
from relax.config.schema import RelaxConfig
from relax.config.store import override_text
from relax.models.checkpoint_files import CheckpointFileError, load_tensor_file
from relax.models.write_errors import torch_save
from relax.runner.errors import RunError
from relax.runner.model_record import FIELDS, RUN_MODEL, differences, model_record, recorded_model, shown
from relax.tracking.params import RESUMABLE_CHANGES, flatten_config
from relax.writable import nearest_existing, try_writing

PREFIX = "step_"
STATE = "state.json"
CONFIG = "config.yaml"
STAGING_PREFIX = ".tmp-"
REPLACED_PREFIX = ".old-"
LOCK = ".lock"
EARLIER = "earlier"  # checkpoints of earlier runs, set aside by a fresh run in the same directory
ROLLOUT_STATE = "rollout.pt"  # the rollout stream: buffered batches, the batch in flight, partial responses
RUN_FILE = "run.json"  # the MLflow run of the job that last used the directory (see Checkpoints.record_run)
FILES = "files"  # state.json's manifest: {relative path: {"size": bytes, "sha256": hex}} of every other file
LOADED_SUFFIXES = (".safetensors", ".pt", ".json", ".bin")  # files a loader would read: never unlisted
HASH_THREADS = 8


def _slug(text: str) -> str:
    return re.sub(r"[^\w.=,+-]+", "_", text).strip("._") or "run"


def run_name(cfg: RelaxConfig) -> str:
    """The run's name for its checkpoint directory: `tracking.run_name`, else `<arm>-seed<seed>`."""
    if cfg.tracking.run_name:
        return str(cfg.tracking.run_name)
    arm = cfg.tracking.arm or cfg.algorithm.name
    return f"{arm}-seed{cfg.seed}"


def default_save_dir(cfg: RelaxConfig, cwd: Optional[Path] = None) -> Path:
    """`<cwd>/checkpoints/<tracking.experiment>/<run name>` (each part made filesystem-safe)."""
    base = Path(os.getcwd() if cwd is None else cwd)
    return base / "checkpoints" / _slug(cfg.tracking.experiment) / _slug(run_name(cfg))


def resolve_save_dir(cfg: RelaxConfig, cwd: Optional[Path] = None) -> Path:
    """`train.save_dir` made absolute (against `cwd`), else `default_save_dir`."""
    if cfg.train.save_dir:
        path = Path(os.path.expanduser(cfg.train.save_dir))
        return path if path.is_absolute() else Path(os.getcwd() if cwd is None else cwd) / path
    return default_save_dir(cfg, cwd)


def step_dir(save_dir: Path, step: int) -> Path:
    return save_dir / f"{PREFIX}{step:06d}"


class CheckpointRefused(RunError):
    """A checkpoint that cannot be used (`path`, `problem`); its message is worded for a resume."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"checkpoint {path} cannot be resumed: {problem}. Nothing was loaded; move the directory "
                         f"away (train.resume=auto then continues the checkpoint before it) or resume another one")
        self.path, self.problem = path, problem


def _refuse(path: Path, problem: str) -> CheckpointRefused:
    return CheckpointRefused(path, problem)


def read_state(path: Path) -> dict:
    """state.json of checkpoint `path`: a JSON object with an integer `step`; RunError naming the file otherwise."""
    file = path / STATE
    try:
        state = json.loads(file.read_bytes())
    except OSError as e:
        raise _refuse(path, f"{file} cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # not JSON, not UTF-8: truncated or overwritten
        raise _refuse(path, f"{file} is damaged (not JSON: {e})") from None
    if not isinstance(state, dict) or type(state.get("step")) is not int:
        raise _refuse(path, f"{file} is damaged (not a JSON object with an integer 'step')")
    return state


def write_rollout_state(directory: Path, state: dict) -> None:
    """The rollout stream's state (`RolloutStream.state_dict`: tensors, lists, numbers, strings) into a checkpoint (a
    failed write raises an OSError naming the file)."""

    torch_save(state, directory / ROLLOUT_STATE)


def read_rollout_state(path: Path) -> dict | None:
    """The rollout stream's state of checkpoint `path`, None if it has none. Loaded with `weights_only=True`: a
    checkpoint file cannot run code; a damaged one is a RunError naming it."""

    file = path / ROLLOUT_STATE
    if not file.is_file():
        return None
    try:
        state = load_tensor_file(file)
    except CheckpointFileError as e:
        raise _refuse(path, str(e)) from None
    if not isinstance(state, dict):
        raise _refuse(path, f"{file} is damaged (not a rollout state)")
    return state


def _committed(save_dir: Path, strict: bool = False) -> list[tuple[Path, dict]]:
    """Committed checkpoints (a `step_*` directory with a readable state.json), oldest commit first.

    A `step_*` directory without state.json is not a checkpoint. One whose state.json is unreadable was damaged
    after its commit: skipped, or with `strict` (what a resume reads) a RunError naming it."""
    if not save_dir.is_dir():
        return []
    found = []
    for path in save_dir.glob(f"{PREFIX}*"):
        if not (path / STATE).is_file():
            continue
        try:
            state = read_state(path)
        except RunError:
            if strict:
                raise
            continue
        found.append((path, state))
    found.sort(key=lambda ps: (_int(ps[1].get("sequence")), ps[1]["step"], ps[0].name))
    return found


def committed(save_dir: Path) -> list[Path]:
    return [p for p, _ in _committed(save_dir)]


def latest(save_dir: Path, strict: bool = False) -> Path | None:
    """The most recently committed checkpoint of `save_dir`, or None (`strict`: see `_committed`)."""
    done = _committed(save_dir, strict)
    return done[-1][0] if done else None


def find(resume: str | None, save_dir: Path) -> Path | None:
    """train.resume: None (fresh start), "auto" (latest in save_dir, fresh if none) or a directory."""
    if resume is None:
        return None
    if resume == "auto":
        return latest(save_dir, strict=True)
    path = Path(os.path.expanduser(resume))
    if not (path / STATE).is_file():
        found = latest(path, strict=True)
        if found is None:
            raise RunError(f"train.resume={resume}: no checkpoint there (expected {STATE} or {PREFIX}* directories)")
        path = found
    return path


def config_differences(saved: Mapping[str, str], current: Mapping[str, str],
                       allowed: tuple[str, ...] = RESUMABLE_CHANGES) -> tuple[dict, dict]:
    """(refused, allowed) differences between two flattened configs: `{field: (checkpoint value, now)}`.

    A field missing on one side counts as a difference (value None there). An empty mapping or list is flattened to
    one key with the value "{}" or "[]" (`flatten_config`), and a filled one to its leaves (`data.eval_sets.a`): the
    marker of the empty side against the leaves of the other is not a field of its own, only its leaves are listed.
    """
    keys = set(saved) | set(current)

    def marker_of_filled(key: str, before: Optional[str], now: Optional[str]) -> bool:
        """`key` is an empty container's marker on one side and the parent of leaves on the other."""
        if {before, now} not in ({"{}", None}, {"[]", None}):
            return False
        other = current if before is not None else saved
        return any(k.startswith(key + ".") for k in other)

    def may_change(key: str) -> bool:
        """`key` is an allowed field, or a leaf of one (`data.eval_sets.a`, `train.eval_pass_k.0`)."""
        return key in allowed or any(key.startswith(field + ".") for field in allowed)

    refused, ok = {}, {}
    for key in sorted(keys):
        before, now = saved.get(key), current.get(key)
        if before != now and not marker_of_filled(key, before, now):
            (ok if may_change(key) else refused)[key] = (before, now)
    return refused, ok


def _int(value: Any) -> int:
    """A state.json step as a number (0 when missing or damaged: `verify` and the sampler's checks report those)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def added_since(saved: Mapping[str, str], current: Mapping[str, str]) -> dict[str, str]:
    """The fields of `current` (flattened) that the checkpoint's config `saved` lacks and that are at this version's
    schema default: fields added to Relax after the checkpoint was written, left at the default they were added
    with, which keeps what runs did before them. Their value for the checkpoint is that default; any other value
    stays a difference. A container's marker (`{}`, `[]`) counts as its default too."""
    from relax.algorithms import get

    missing = [k for k in current if k not in saved]
    if not missing:
        return {}
    try:
        algorithm = get(str(saved.get("algorithm.name")))
        defaults = flatten_config(RelaxConfig(algorithm=algorithm.config_cls()))
    except Exception:  # noqa: BLE001 - an algorithm this version lacks: nothing is taken for a default
        return {}
    return {k: current[k] for k in missing if k in defaults and defaults[k] == current[k]}


def _flat(cfg: RelaxConfig) -> dict[str, str]:

    return flatten_config(cfg)


# state.json: the run's MLflow store as the run resolved it (tracking.uri is often relative to where relax-train
# ran, e.g. the default sqlite:///mlflow.db, which names another store from any other directory)
TRACKING_URI_STATE = "tracking_uri"
# state.json's record of the run's prompt sets: a list of `relax.tracking.inputs.DatasetRecord.to_dict()` (the training
# set, context train, and each eval set, context eval: name, source, digest, num_prompts, ...), those the run logs to
# MLflow (`relax.runner.session.dataset_records`); a resume compares their digest and size (`check_run_data`)
RUN_DATA = "run_data"
# what RUN_DATA's digests mean: bump it when the digest (`relax.tracking.inputs.prompts_digest`) or how a prompt is
# rendered before it (chat template application, system prompt, tool schemas) changes, so that checkpoints written
# before continue with a note instead of a refusal
RUN_DATA_VERSION = 1
RUN_DATA_VERSION_KEY = "run_data_version"


@dataclass
class ResumePoint:
    """A checkpoint a run continues, its state, and the (allowed) config fields that changed since it was written."""

    path: Path
    state: dict
    changed: dict = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def run_id(self) -> Optional[str]:
        return self.state.get("mlflow_run_id")

    @property
    def lineage(self) -> Optional[str]:
        return self.state.get("lineage")

    @property
    def tracking_uri(self) -> Optional[str]:
        """The MLflow store the run was recorded in, resolved (absolute) when the checkpoint was written; None for
        checkpoints written before it was kept, or without tracking."""
        return self.state.get(TRACKING_URI_STATE)

    @property
    def tracker_state(self) -> dict:
        return self.state.get("tracker") or {}


def resume_point(cfg: RelaxConfig, save_dir: Path, *, hashes: bool = True,
                 data: Optional[Sequence[Mapping[str, Any]]] = None) -> ResumePoint | None:
    """The checkpoint `train.resume` designates, checked against `cfg` and `verify`'d (`hashes`: with its files'
    SHA-256); RunError naming the fields if it differs. `data`: the run's prompt sets as it reads them now (`RUN_DATA`
    records), checked against the checkpoint's (`check_run_data`); None: not checked (not read)."""
    path = find(cfg.train.resume, save_dir)
    if path is None:
        return None
    state = read_state(path)
    if not isinstance(state.get("sampler", {}), dict):
        raise _refuse(path, f"{path / STATE} is damaged ('sampler' is not an object)")
    saved = state.get("config")
    if saved is None:  # written before checkpoints recorded their config
        print(f"relax-train: warning: checkpoint {path} records no config; continuing it unchecked", file=sys.stderr)
        check_num_rollout(cfg, path, state)
        check_run_model(cfg, path, state)
        check_run_data(cfg, path, state, data)
        verify(path, state, hashes=hashes)
        return ResumePoint(path, state)
    if not isinstance(saved, dict):
        raise _refuse(path, f"{path / STATE} is damaged ('config' is not an object)")
    current = _flat(cfg)
    added = added_since(saved, current)
    if added:
        print(f"relax-train: warning: checkpoint {path} was written before "
              f"{', '.join(f'{k} (now {v})' for k, v in sorted(added.items()))} existed; "
              "continuing it with their defaults, which keep what runs did before them", file=sys.stderr)
    refused, changed = config_differences({**saved, **added}, current)
    why = ""
    if "train.eval_interval" in changed and cfg.train.mode == "fully_async" and cfg.train.weight_sync_interval > 1 \
            and _int(state.get("step")) < cfg.train.num_rollout:
        refused["train.eval_interval"] = changed.pop("train.eval_interval")
        why = (f"train.eval_interval cannot change here: with train.mode=fully_async and train.weight_sync_interval="
               f"{cfg.train.weight_sync_interval}, the weights published before each evaluation reach the rollouts "
               "that follow, so the interval changes what the remaining steps train on.\n")
    if refused:
        lines = "\n".join(f"  {key}: {before} -> {now}" for key, (before, now) in refused.items())
        n = len(refused)
        if cfg.train.num_rollout == 0:  # evaluating it: its run's own config is the one that fits, none retyped
            advice = (f"To evaluate it, give its run's own config (its config.yaml) and the options to change: "
                      f"relax-train -cp {path} -cn config {override_text('train.resume', path)} "
                      "train.num_rollout=0 ...")
        else:
            advice = ("Run with the checkpoint's values to continue it, or start a new run elsewhere "
                      "(tracking.run_name=... or train.save_dir=...).")
        raise RunError(
            f"train.resume={cfg.train.resume}: checkpoint {path} was written with a different config, so this run "
            f"cannot continue it ({n} field{'s differ' if n > 1 else ' differs'}, checkpoint -> now):\n{lines}\n"
            f"{why}Only {', '.join(RESUMABLE_CHANGES)} may change on resume. {advice}"
        )
    check_num_rollout(cfg, path, state)
    check_run_model(cfg, path, state)
    check_run_data(cfg, path, state, data, changed)
    verify(path, state, hashes=hashes)
    return ResumePoint(path, state, changed)


def check_num_rollout(cfg: RelaxConfig, path: Path, state: dict) -> None:
    """Refuse a resume whose `train.num_rollout` (the run's total number of training steps, not the steps to add) is
    above 0 and below the checkpoint's step: such a run has nothing to train and is no evaluation either
    (`train.num_rollout=0`, or the checkpoint's own step, evaluates it); RunError naming both numbers and what to
    type instead."""
    step, n = _int(state.get("step")), cfg.train.num_rollout
    if not 0 < n < step:
        return
    raise RunError(
        f"train.resume={cfg.train.resume}: train.num_rollout={n} is below the {step} steps checkpoint {path} holds, "
        f"so this run would train nothing: train.num_rollout is the run's total number of steps, not the steps to "
        f"add. To train it further give the total, e.g. train.num_rollout={step + n} ({n} more step"
        f"{'s' if n > 1 else ''}); to evaluate it, train.num_rollout=0 (or {step})")


def check_run_model(cfg: RelaxConfig, path: Path, state: dict) -> None:
    """Refuse a resume whose model files (`model.path`, whose value the config check found unchanged) are no longer
    the model the run trained from: their record (`relax.runner.model_record`: config architectures, vocab_size,
    tokenizer and chat template digests) differs from the one in the checkpoint's state.json. The run would go on
    with the checkpoint's weights but another tokenizer, chat template or EOS: RunError in one line naming each
    field that differs with both values. A checkpoint without the record (an older Relax's, or one whose run could
    not read its model files) continues with a note that the check could not be made. The record is cached per model
    files (`model_record`), so the commits that follow reuse it."""
    if cfg.model.source == "config":  # no model files: nothing is recorded or compared
        return
    from relax.data.tokenizer import resolve_model_path

    recorded = state.get(RUN_MODEL)
    try:
        where = (f"model.path={cfg.model.path}" if cfg.model.path else
                 f"the model files at {resolve_model_path(cfg.model)}")
    except Exception:  # noqa: BLE001 - no model files: preflight's model check, which runs first, names the problem
        return
    if not isinstance(recorded, dict):
        why = ("was written by an older Relax" if RUN_MODEL not in state else
               "records that its run could not read its model files")
        print(f"relax-train: note: checkpoint {path} {why}: it does not say which model the run trained from, so "
              f"{where} is not checked against it", file=sys.stderr, flush=True)
        return
    try:
        now = model_record(cfg.model)
    except Exception:  # noqa: BLE001 - unreadable model files: preflight's model check, which runs first, names them
        return
    assert now is not None
    differ = differences(recorded, now)
    if differ:
        fields = "; ".join(f"{FIELDS[k]}: {shown(k, recorded[k])} in the run, {shown(k, now[k])} now" for k in differ)
        raise RunError(f"train.resume={cfg.train.resume}: {where} no longer holds the model that checkpoint {path} was "
                       f"trained from ({fields}): its files were replaced since the run; point model.path at the "
                       "run's model to continue it, or start a new run")


def check_run_data(cfg: RelaxConfig, path: Path, state: dict, data: Optional[Sequence[Mapping[str, Any]]],
                   changed: Optional[Mapping[str, Any]] = None) -> None:
    """Refuse a resume whose prompt files (`data.path`, an eval set's file, whose names the config check found
    unchanged) no longer hold the prompts the run used: a prompt set's digest or size (`RUN_DATA`, those of the MLflow
    dataset log: the prompts as the model sees them and their labels) differs from the checkpoint's. The run would go
    on from the sampler's position on other prompts and labels (a file regenerated at the same path). `data`: the
    records now (None: the prompt sets were not read, nothing is checked). RunError in one line naming the set, its
    option and file, both sizes and digests, and what to do. An eval set whose options changed on this resume
    (`changed`: data.num_eval_prompts, its data.eval_sets entry, data.eval_path for the default set; changes a resume
    allows) is meant to differ and is not compared; an evaluation-only resume (train.num_rollout=0, or the
    checkpoint's step) trains nothing and does not compare the training set. The digest covers the prompts as rendered
    and their labels, not a record's other fields (what a reward reads by name) or its images. A checkpoint without
    the record, or with one of another RUN_DATA_VERSION (an older Relax's), continues with a note that the check
    could not be made."""
    if data is None:
        return
    recorded = state.get(RUN_DATA)
    current = {(r.get("context"), r.get("name")): r for r in data}
    where = (f"data.path={cfg.data.path}" if cfg.data.path else f"data={cfg.data.name}")
    if not isinstance(recorded, list) or state.get(RUN_DATA_VERSION_KEY) != RUN_DATA_VERSION:
        print(f"relax-train: note: checkpoint {path} was written by an older Relax: it does not say which prompts the "
              f"run used, so {where} is not checked against it", file=sys.stderr, flush=True)
        return
    trains = cfg.train.num_rollout > _int(state.get("step"))
    changed = changed or {}
    default_eval = default_eval_set_name(cfg.data)
    for before in recorded:
        if not isinstance(before, dict):
            continue
        context, name = before.get("context"), before.get("name")
        now = current.get((context, name))
        if now is None or (before.get("digest"), before.get("num_prompts")) == (now.get("digest"),
                                                                                 now.get("num_prompts")):
            continue
        if context == "train":
            if not trains:
                continue  # an evaluation: no training prompt is read
            what, option, used = f"the training set {name!r}", where, "trained on"
            instead = ""
        else:
            entry = f"data.eval_sets.{name}"
            if "data.num_eval_prompts" in changed or any(k == entry or k.startswith(entry + ".") for k in changed) \
                    or (name == default_eval and name not in cfg.data.eval_sets and "data.eval_path" in changed):
                continue  # its options changed on this resume: another set, which a resume may evaluate
            option = (entry if name in cfg.data.eval_sets else
                      f"data.eval_path={cfg.data.eval_path}" if cfg.data.eval_path else f"data={cfg.data.name}")
            what, used = f"the eval set {name!r}", "evaluated on"
            # another set under its own name is what a resume may evaluate (its options changed: skipped above)
            instead = ", give the new file under another path (data.eval_path or a data.eval_sets entry)"
        local = now.get("source_type") == "local"
        source = f" (file {now.get('source')})" if local and str(now.get("source")) not in option else ""
        # the digest is of the prompts as rendered: the file, or what renders them, changed
        why = ("the file, or what renders its prompts (the chat template, data.system_prompt, tools), changed since "
               "the run; put the run's file and settings back to continue it" if local else
               "its prompts changed since the run (its files, or the Relax that makes them); continue it with the "
               "run's")
        raise RunError(
            f"train.resume={cfg.train.resume}: {option}{source} no longer holds the prompts that checkpoint {path} was "
            f"{used} ({what}: {before.get('num_prompts')} prompts, digest {before.get('digest')} in the run, "
            f"{now.get('num_prompts')} prompts, digest {now.get('digest')} now): {why}{instead}, or start a new run "
            "(tracking.run_name=... or train.save_dir=...)")


# what names a run's default checkpoint directory (`run_name`): a checkpoint of the experiment that differs from a run
# only in these (and in what may change on resume) is the same run under another seed or name
_NAMING_FIELDS = ("seed", "tracking.run_name", "tracking.arm")
_SIBLINGS_SHOWN = 3


def resume_note(cfg: RelaxConfig, cwd: Optional[Path] = None) -> Optional[str]:
    """What `train.resume=auto` will do, in one line (None for any other train.resume): which checkpoint it continues,
    or that there is none in the save directory, so that the run starts at step 1 as a new run. A new run is what
    `auto` means then (as in verl and TRL), but the directory is named by the seed and run name: a changed seed starts
    afresh. So the note also names checkpoints of the same experiment whose config differs from this run's only in
    the seed or run name (`_NAMING_FIELDS`): most often the run the user meant to continue. The dry run's checkpoints
    line and the start (`Checkpoints`) both say it."""
    if cfg.train.resume != "auto":
        return None
    save_dir = resolve_save_dir(cfg, cwd)
    done = _committed(save_dir)
    if done:
        path, state = done[-1]
        return f"train.resume=auto continues {path} (step {_int(state.get('step'))})"
    text = f"train.resume=auto: no checkpoint in {save_dir}, so this run starts at step 1 as a new run"
    others = _same_run_elsewhere(cfg, save_dir)
    if others:
        listed = "; ".join(f"{path} (step {step}, {how})" for path, step, how in others[:_SIBLINGS_SHOWN])
        more = f" and {len(others) - _SIBLINGS_SHOWN} more" if len(others) > _SIBLINGS_SHOWN else ""
        how = f"run with {others[0][2]}" if len(others) == 1 else "run with its values"
        text += (f". Checkpoints of the same config with another seed or run name: {listed}{more}. A run continues "
                 f"only under its own seed and run name (they name its checkpoint directory): to continue "
                 f"{'that one' if len(others) == 1 else 'one of those'}, {how}")
    return text


def _same_run_elsewhere(cfg: RelaxConfig, save_dir: Path) -> list[tuple[Path, int, str]]:
    """The latest checkpoints in the other run directories of the experiment's default directory whose config
    differs from `cfg` only in `_NAMING_FIELDS` (and `RESUMABLE_CHANGES`): (path, step, 'seed=1, ...'). None with
    `train.save_dir` set: its parent is the user's, not a directory of runs."""
    if cfg.train.save_dir:
        return []
    current = _flat(cfg)
    found = []
    try:
        siblings = sorted(p for p in save_dir.parent.iterdir() if p.is_dir() and p != save_dir)
    except OSError:
        return []
    for directory in siblings:
        done = _committed(directory)
        if not done:
            continue
        path, state = done[-1]
        saved = state.get("config")
        if not isinstance(saved, dict):
            continue
        saved = {**saved, **added_since(saved, current)}
        refused, _ = config_differences(saved, current, RESUMABLE_CHANGES + _NAMING_FIELDS)
        naming = {k: saved.get(k) for k in ("seed", "tracking.run_name") if saved.get(k) != current.get(k)}
        if not refused and naming:
            found.append((path, _int(state.get("step")), ", ".join(f"{k}={v}" for k, v in naming.items())))
    return found


def _files(root: Path) -> list[Path]:
    """Every file under `root` except its state.json, in a stable order."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p != root / STATE)


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)  # releases the GIL: files hash in parallel threads
    return h.hexdigest()


def _sha256_all(files: list[Path]) -> list[str]:
    if len(files) <= 1:
        return [_sha256(f) for f in files]
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(files))) as pool:
        return list(pool.map(_sha256, files))


def manifest(root: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of every file under `root` except state.json (what `commit` records)."""
    files = _files(root)
    return {f.relative_to(root).as_posix(): {"size": f.stat().st_size, "sha256": d}
            for f, d in zip(files, _sha256_all(files), strict=True)}


def verify(path: Path, state: dict, *, hashes: bool = True) -> None:
    """Check checkpoint `path` before anything loads it: every file of its manifest is there with its committed size
    and SHA-256 (`hashes=False`: the size alone, for a check ahead of the start that will hash them, such as a
    sweep's precheck: reading a large checkpoint twice would delay every job), and no unlisted file a loader would
    read (`LOADED_SUFFIXES`) was added. Without a manifest (written before them): every file a loader reads parses
    (safetensors headers, weights-only torch files, JSON). RunError naming the first bad file."""
    files = state.get(FILES)
    if files is None:
        _check_formats(path)
        return
    if not isinstance(files, dict):
        raise _refuse(path, f"{path / STATE} is damaged ('{FILES}' is not an object)")
    listed: list[tuple[Path, str]] = []
    for rel, entry in sorted(files.items()):
        parts = Path(rel).parts
        if (Path(rel).is_absolute() or ".." in parts or not isinstance(entry, dict)
                or type(entry.get("size")) is not int or not isinstance(entry.get("sha256"), str)):
            raise _refuse(path, f"{path / STATE} is damaged (bad '{FILES}' entry {rel!r})")
        file = path / rel
        if not file.is_file():
            raise _refuse(path, f"{file} is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise _refuse(path, f"{file} is damaged: {size} bytes, {entry['size']} when it was committed"
                          + (" (truncated)" if size < entry["size"] else ""))
        listed.append((file, entry["sha256"]))
    if hashes:
        for (file, expected), digest in zip(listed, _sha256_all([f for f, _ in listed]), strict=True):
            if digest != expected:
                raise _refuse(path, f"{file} was changed after the checkpoint was committed (its SHA-256 differs "
                              f"from the one in {STATE})")
    known = {f for f, _ in listed}
    for file in _files(path):
        if file not in known and file.suffix in LOADED_SUFFIXES:
            raise _refuse(path, f"{file} is not part of the checkpoint as committed (not listed in {STATE})")


def _check_formats(path: Path) -> None:
    """The files of a checkpoint without a manifest that a loader reads, parsed without loading tensor data."""
    from safetensors import safe_open


    for file in _files(path):
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt"):
                    pass  # header and sizes checked on open, tensors not read
            elif file.suffix == ".pt":
                load_tensor_file(file, map_location="cpu", mmap=True)
            elif file.suffix == ".json":
                json.loads(file.read_bytes())
        except CheckpointFileError as e:
            raise _refuse(path, str(e)) from None
        except Exception as e:  # SafetensorError, JSONDecodeError, UnicodeDecodeError, OSError
            raise _refuse(path, f"{file} is damaged or truncated: {e}") from None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, so that a committed checkpoint survives a power cut."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _in_use(save_dir: Path) -> str:
    return (f"checkpoint directory {save_dir} is in use by another running relax-train (it holds {save_dir / LOCK}); "
            "give this run another tracking.run_name or train.save_dir")


# flock's errors for a filesystem that has no flock (NFS without its lock daemon: ENOLCK; FUSE mounts such as s3fs or
# gcsfuse: EOPNOTSUPP or ENOSYS; Lustre mounted without -o flock: ENOSYS); only EWOULDBLOCK means another holder
NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


def _errno_text(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{exc.strerror or exc} ({name})"


def _flock(fd: int, save_dir: Path) -> bool:
    """An exclusive, non-blocking flock on `fd` (the directory's lock file): True when held. RunError when another
    process holds it, or for an errno that says neither that nor "no flock here"; False (after a warning) on a
    filesystem without flock. There the run goes on unlocked rather than being refused: the lock only guards against
    a second run in the same directory at the same time, while refusing would leave no way to save checkpoints on
    such a filesystem at all (and "in use by another relax-train", the old message, sent the user after a run that
    does not exist)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:  # EWOULDBLOCK / EAGAIN: held by another process
        raise RunError(_in_use(save_dir)) from None
    except OSError as exc:
        if exc.errno in NO_FLOCK:
            print(f"relax-train: warning: cannot lock checkpoint directory {save_dir}: flock on {save_dir / LOCK} "
                  f"failed with {_errno_text(exc)}: the filesystem of train.save_dir does not support flock; going "
                  "on without the lock, so nothing stops a second relax-train from writing to this directory at the "
                  "same time (run one job per train.save_dir, or put it on a filesystem with flock)", file=sys.stderr,
                  flush=True)
            return False
        raise RunError(f"cannot lock checkpoint directory {save_dir}: flock on {save_dir / LOCK} failed with "
                       f"{_errno_text(exc)}; set train.save_dir to a directory on a local or flock-capable "
                       "filesystem") from None


def _cannot_create(save_dir: Path, exc: OSError) -> str:
    return f"checkpoint directory {save_dir} cannot be created ({exc.strerror or exc}); set train.save_dir"


def _cannot_write(save_dir: Path, exc: OSError) -> str:
    return (f"checkpoint directory {save_dir} cannot be written ({exc.strerror or exc}), and this run saves "
            "checkpoints there; set train.save_dir to a writable directory (to evaluate its checkpoint where it is, "
            "train.num_rollout=0)")


def probe(cfg: RelaxConfig, cwd: Optional[Path] = None, *, hashes: bool = True,
          data: Optional[Sequence[Mapping[str, Any]]] = None) -> bool:
    """What entering `Checkpoints` checks, changing nothing (`dry_run=true`, `relax.runner.preflight`): the save
    directory is not locked by another run and can be created, and the resume point is valid (RunError naming the
    problem; `hashes=False`: its files' sizes, not their SHA-256, as `verify` says). False when the run neither saves
    nor resumes (nothing to check)."""
    ckpts = Checkpoints(cfg, cwd)
    save_dir = ckpts.save_dir
    if ckpts.uses_dir:
        if (save_dir / LOCK).exists():
            fd = os.open(save_dir / LOCK, os.O_RDONLY)
            try:
                _flock(fd, save_dir)  # released by the close below
            finally:
                os.close(fd)
            if ckpts.writes:  # a directory used before, now read-only (a read-only mount, chattr +i): as `_lock`
                try:
                    try_writing(save_dir)
                except OSError as exc:
                    raise RunError(_cannot_write(save_dir, exc)) from None
        else:
            existing = nearest_existing(save_dir)
            if not existing.is_dir():
                raise RunError(_cannot_create(save_dir, OSError(f"{existing} is not a directory")))
            try:
                try_writing(existing)
            except OSError as exc:
                why = OSError(f"{existing} is not writable ({exc.strerror or exc})")
                raise RunError(_cannot_create(save_dir, why)) from None
    resume_point(cfg, save_dir, hashes=hashes, data=data)
    return ckpts.uses_dir or cfg.train.resume is not None


def put_back(save_dir: Path, moves: Sequence[tuple[Path, Path]], *, locked: bool = True) -> int:
    """Move earlier runs' checkpoints that a fresh run set aside in `earlier/` (`moves`: (where, where to) of each,
    `Checkpoints.set_aside`) back where they were, those whose place is still free, and say so; the number moved
    back. For a fresh run that fails before its first step: the directory is left as that run found it, and
    `train.resume=auto` still continues the earlier run. `locked`: the caller holds the directory's lock; else it is
    taken here (`relax.runner.train.run` puts them back once an attempt has released it), and when another process
    holds it (a relax-train that started in the directory since: it found nothing to set aside and writes its own
    checkpoints there) nothing moves, so theirs never mix with that run's: they stay aside, and the note says where
    (and so when flock fails otherwise than for a filesystem without it, `NO_FLOCK`, where they move unlocked)."""
    moves = [(path, dest) for path, dest in moves if dest.exists()]  # not those already back (the Session's)
    if not moves:
        return 0
    fd = None
    if not locked:
        with contextlib.suppress(OSError):  # the directory gone since: nothing is there to move back (below)
            fd = os.open(save_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    if fd is not None:
        why = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            why = f"another relax-train holds {save_dir} now"
        except OSError as exc:
            if exc.errno not in NO_FLOCK:  # not "no flock here" (warned at the start): moving unlocked is unsafe
                why = f"the lock of {save_dir} cannot be taken (flock on {save_dir / LOCK} failed with " \
                      f"{_errno_text(exc)})"
        if why is not None:
            os.close(fd)
            where = sorted({str(dest.parent) for _, dest in moves})
            resume = override_text("train.resume", where[0]) if len(where) == 1 else "train.resume=<one of them>"
            print(f"relax-train: note: the run did not start; {why}, so the {len(moves)} checkpoint(s) of the "
                  f"earlier run stay in {', '.join(where)} ({resume} continues that run)", file=sys.stderr)
            return 0
    try:
        back = 0
        for path, dest in reversed(list(moves)):
            if dest.exists() and not path.exists():
                dest.rename(path)
                back += 1
                with contextlib.suppress(OSError):  # earlier/<lineage>/ (and earlier/) emptied: as before the move
                    dest.parent.rmdir()
                    dest.parent.parent.rmdir()
        if back:
            _fsync(save_dir)
    finally:
        if fd is not None:
            os.close(fd)
    if back:
        print(f"relax-train: note: the run did not start; {back} checkpoint(s) of the earlier run moved back to "
              f"{save_dir}", file=sys.stderr)
    return back


def config_yaml(cfg: RelaxConfig) -> str:
    """`cfg` as the YAML a run writes (config.resolved.yaml, each checkpoint's config.yaml): the text
    `OmegaConf.to_yaml(OmegaConf.structured(cfg))` gives, which earlier versions wrote and a resume reads, from the
    frozen dataclass's plain values through the same dumper, without building an OmegaConf node of the whole schema
    first (tests/runner/test_config_yaml.py holds the two renderings equal)."""
    import yaml
    from omegaconf._utils import get_omega_conf_dumper

    return yaml.dump(_as_omegaconf_gives(asdict(cfg)), default_flow_style=False, allow_unicode=True, sort_keys=False,
                     Dumper=get_omega_conf_dumper())


def _as_omegaconf_gives(value: Any) -> Any:
    """A config's plain value as OmegaConf's container of it holds it: an enum (a plugin's config may declare one) by
    its name, a tuple as a list (YAML's dumper would tag both as Python objects, which no config loader reads)."""
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, dict):
        return {_as_omegaconf_gives(k): _as_omegaconf_gives(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_omegaconf_gives(v) for v in value]
    return value


class Checkpoints:
    """The checkpoint directory of one run: its lock, what the run resumes from, atomic commits and pruning.

    Use as a context manager around the run. Entering locks the directory (when the run saves or resumes
    from it), deletes what interrupted saves left behind, and finds and checks the resume point (`resume`).
    """

    def __init__(self, cfg: RelaxConfig, cwd: Optional[Path] = None,
                 data: Optional[Sequence[Mapping[str, Any]]] = None):
        self.cfg = cfg
        self.cwd = cwd
        # the run's prompt sets (`RUN_DATA` records): the resume point is checked against them and every checkpoint
        # records them; None: not read (nothing checked, nothing recorded)
        self.data = [dict(r) for r in data] if data is not None else None
        self.save_dir = resolve_save_dir(cfg, cwd)
        self.keep = cfg.train.keep_checkpoints  # >= 1 (validation)
        self.resume: ResumePoint | None = None
        self.lineage = uuid.uuid4().hex
        self.previous_run_id: Optional[str] = None  # the MLflow run of the last job in this directory
        # the store that run is in (resolved tracking.uri); None in a run.json written before stores were recorded
        self.previous_run_uri: Optional[str] = None
        self._lock_fd: Optional[int] = None
        # the directory cannot be written, and the run only reads it (`_lock`): nothing is cleaned or recorded there
        self.read_only = False
        self._set_aside: list[tuple[Path, Path]] = []  # (where, where to) of each earlier checkpoint moved aside
        # Files the run adds to every checkpoint it commits, whoever calls `commit`: {file name: the text of the
        # checkpoint of step -> str}, written into the staging directory before its manifest (so a resume checks
        # them like every other file). Session adds the sample ledger.
        self.attachments: dict[str, Callable[[int], str]] = {}

    @functools.cached_property
    def config_yaml(self) -> str:
        """The run's config as YAML, each checkpoint's config.yaml (rendered once: the config is frozen)."""
        return config_yaml(self.cfg)

    @property
    def writes(self) -> bool:
        """Whether the run may commit checkpoints: `train.save`, and steps to train (`train.num_rollout=0`, an
        evaluation-only run, trains none, so it neither locks the directory nor sets earlier runs aside)."""
        return bool(self.cfg.train.save) and self.cfg.train.num_rollout > 0

    @property
    def uses_dir(self) -> bool:
        return self.writes or self.cfg.train.resume == "auto"

    def __enter__(self) -> Checkpoints:
        if self.uses_dir:
            self._lock()
            if not self.read_only:
                self._clean()
            try:
                recorded = json.loads((self.save_dir / RUN_FILE).read_text())
                self.previous_run_id = recorded.get("mlflow_run_id")
                self.previous_run_uri = recorded.get("tracking_uri")
            except (OSError, ValueError, AttributeError):
                self.previous_run_id = self.previous_run_uri = None
        try:
            self.resume = resume_point(self.cfg, self.save_dir, data=self.data)
        except BaseException:
            self._unlock()
            raise
        if self.resume is None and self.cfg.train.resume == "auto":
            print(f"relax-train: note: {resume_note(self.cfg, self.cwd)}", file=sys.stderr, flush=True)
        if self.resume is not None and self.resume.lineage:
            self.lineage = self.resume.lineage
        elif self.writes:
            self._set_aside_earlier_runs()
        return self

    def _set_aside_earlier_runs(self) -> None:
        """A fresh run where earlier runs left checkpoints: move them to `earlier/<lineage>/` (a rename, nothing is
        deleted), so that this run's checkpoints never mix with theirs and `resume=auto` continues this run."""
        moved: dict[Path, int] = {}
        for path, state in _committed(self.save_dir):
            target = self.save_dir / EARLIER / str(state.get("lineage") or "unknown")
            target.mkdir(parents=True, exist_ok=True)
            dest = target / path.name
            if dest.exists():
                dest = target / f"{path.name}-{uuid.uuid4().hex[:8]}"
            path.rename(dest)
            self._set_aside.append((path, dest))
            moved[target] = moved.get(target, 0) + 1
        for target, n in moved.items():
            _fsync(target)
            print(f"relax-train: note: this fresh run moved {n} checkpoint(s) of an earlier run in {self.save_dir} to "
                  f"{target} ({override_text('train.resume', target)} continues that run)", file=sys.stderr)
        if moved:
            _fsync(self.save_dir)

    @property
    def set_aside(self) -> list[tuple[Path, Path]]:
        """(where, where to) of each earlier run's checkpoint this run moved to `earlier/` (and has not put back)."""
        return list(self._set_aside)

    def put_back_earlier_runs(self) -> int:
        """Move the checkpoints `_set_aside_earlier_runs` set aside back where they were (`put_back`); the number
        moved back. For a fresh run that fails before its first step (its MLflow run cannot be opened, ...)."""
        back = put_back(self.save_dir, self._set_aside)
        self._set_aside = []
        return back

    def __exit__(self, *exc: Any) -> None:
        self._unlock()

    def _lock(self) -> None:
        try:
            self.save_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunError(_cannot_create(self.save_dir, exc)) from None
        lock = self.save_dir / LOCK
        if not self.writes and lock.exists():
            # a run that commits nothing (`writes`: an evaluation of the checkpoint, train.num_rollout=0) in a
            # directory it cannot write (a read-only mount; chattr +i, where its .lock itself may still open for
            # writing): it locks the lock file read-only, which flock locks all the same, and writes nothing there
            try:
                try_writing(self.save_dir)
            except OSError:
                self.read_only = True
        try:
            fd = os.open(lock, os.O_RDONLY if self.read_only else os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if self.writes:
                raise RunError(_cannot_write(self.save_dir, exc)) from None
            raise RunError(f"cannot lock checkpoint directory {self.save_dir}: {lock} cannot be "
                           f"{'opened' if self.read_only else 'created'} ({exc.strerror or exc}); set train.save_dir"
                           ) from None
        try:
            held = _flock(fd, self.save_dir)
        except BaseException:
            os.close(fd)
            raise
        if not held:  # a filesystem without flock: the run goes on unlocked (warned)
            os.close(fd)
            return
        self._lock_fd = fd

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def record_run(self, run_id: Optional[str], tracking_uri: Optional[str] = None) -> None:
        """Note the job's MLflow run and its store (`tracking_uri`, resolved) in the directory, so that a later job
        there can close it if this one is killed before its first checkpoint (the lock proves that whoever wrote it
        is gone): in that store, which need not be the later job's (train.save_dir's default is shared by runs of
        every tracking.uri)."""
        if not self.locked or run_id is None or self.read_only:
            return
        tmp = self.save_dir / f"{STAGING_PREFIX}{RUN_FILE}"
        _write(tmp, json.dumps({"mlflow_run_id": run_id, "tracking_uri": tracking_uri, "lineage": self.lineage}))
        tmp.replace(self.save_dir / RUN_FILE)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def _clean(self) -> None:
        """Delete the half-written (`.tmp-`) and half-replaced (`.old-`) directories of an interrupted save, and the
        staging directory of an interrupted export to `hf/` (`train.save_hf`, `.tmp-hf-*`)."""
        patterns = [f"{prefix}{PREFIX}*" for prefix in (STAGING_PREFIX, REPLACED_PREFIX)] + [f"{STAGING_PREFIX}hf-*"]
        for pattern in patterns:
            for path in self.save_dir.glob(pattern):
                shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ saving
    def staging_path(self, step: int) -> Path:
        """`.tmp-step_NNNNNN/`: where the checkpoint of `step` is written before its commit."""
        return self.save_dir / f"{STAGING_PREFIX}{PREFIX}{step:06d}"

    def discard(self, step: int) -> bool:
        """Remove what a failed save of `step` left in its staging directory (committed checkpoints are never
        touched); True if nothing of it is left."""
        path = self.staging_path(step)
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()

    def staging(self, step: int) -> Path:
        """An empty `.tmp-step_NNNNNN/` to write the checkpoint of `step` into."""
        path = self.staging_path(step)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def commit(self, staging: Path, step: int, state: dict) -> Path:
        """Complete `staging` with the attachments, state.json and config.yaml, make it durable, rename it, then prune
        older ones."""
        existing = _committed(self.save_dir)
        sequence = 1 + max((_int(s.get("sequence")) for _, s in existing), default=0)
        full = {**state, "step": step, "lineage": self.lineage, "sequence": sequence, "config": _flat(self.cfg),
                RUN_MODEL: recorded_model(self.cfg.model)}  # what relax-export checks its model files against
        if self.data is not None:
            full[RUN_DATA] = self.data  # what a resume checks the prompt files against (`check_run_data`)
            full[RUN_DATA_VERSION_KEY] = RUN_DATA_VERSION
        for name, text in self.attachments.items():
            _write(staging / name, text(step))
        _write(staging / CONFIG, self.config_yaml)
        full[FILES] = manifest(staging)
        _write(staging / STATE, json.dumps(full, indent=2))
        _fsync_tree(staging)
        final = step_dir(self.save_dir, step)
        replaced = None
        if final.exists():  # the same step again (resumed from an older checkpoint): move the old one aside first
            replaced = self.save_dir / f"{REPLACED_PREFIX}{final.name}"
            if replaced.exists():
                shutil.rmtree(replaced)
            final.rename(replaced)
        try:
            staging.rename(final)
        except OSError:
            if replaced is not None:  # the checkpoint it was to replace stays committed
                replaced.rename(final)
            raise
        _fsync(self.save_dir)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        self._prune()
        return final

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints of this run and remove its older ones: each is first renamed out of
        the `step_*` namespace, so a kill during the removal never leaves a half-deleted "committed" checkpoint."""
        kept = 0
        for path, state in reversed(_committed(self.save_dir)):
            if state.get("lineage") != self.lineage:
                continue
            if kept < self.keep:
                kept += 1
                continue
            doomed = path.with_name(f"{REPLACED_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
            path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
