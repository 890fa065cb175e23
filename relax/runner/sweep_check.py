"""The sweep launcher's check of each job before any starts (`hydra.launcher.precheck`): what a single run checks
before Ray (`relax.runner.preflight`), the addresses it must reach (`relax.runner.endpoints`), and the checkpoint
directory each job needs to itself. Its own module: preflight runs the endpoints check, and this runs both."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from relax.config import to_relax_config
from relax.config.schema import TrackingConfig
from relax.runner import checkpoint
from relax.runner.endpoints import endpoint_targets, unreachable_endpoints
from relax.runner.errors import RunError
from relax.runner.preflight import INPUT_CHECKS, preflight

# the checks of relax.runner.preflight a sweep runs on each job before any starts (`check_sweep_job`): the user's
# inputs (model files, tokenizer, data and eval files, reward, ...), a sqlite tracking store's file and directory
# (`tracking`: before the sweep opens its parent run there) and the checkpoint directory (not in use, can be
# created; train.resume's checkpoint exists, its files have their committed sizes (the job checks their SHA-256 at its
# start: hashing every job's checkpoint here too would read each twice before any job starts) and it was written with
# a config this job may continue). Not
# `endpoints` (checked here, every address at once) nor `gpus` (the jobs join the sweep's Ray, not a local one).
SWEEP_CHECKS = ("model", "tokenizer", "teacher", "data", "reward", "reward_model", "tool_parser", "agent",
                "openai_agent", "lora", "tracking", "checkpoints")
_INPUTS_CHECKED: dict[tuple[str, str], dict[str, str]] = {}  # one sweep's input problems, by config less the seed


class SweepJobError(RunError):
    """What `check_sweep_job` found wrong with a job: `problems`, each a message, and `store`, the message of an
    MLflow tracking store (tracking.uri) that cannot be reached, kept apart (None: none such): the launcher says it
    once, as what it is (no invalid config), naming the store without secrets (as
    `relax.runner.endpoints` names every http(s) address)."""

    def __init__(self, problems: list[str], store: Optional[str] = None):
        every = ([store] if store is not None else []) + problems
        super().__init__(every[0] if len(every) == 1 else
                         f"{len(every)} problems:\n" + "\n".join(f"  - {t}" for t in every))
        self.problems, self.store = problems, store


def unreachable_store(problem: str) -> str:
    """The message of a tracking store that cannot be reached, from its `relax.runner.endpoints.Unreachable` message
    (`tracking.uri=<uri>: <why>`, which names the URI without secrets already)."""
    return f"the MLflow tracking store is unreachable: {problem}"


def check_sweep_job(dc: Any, overrides: Optional[Sequence[str]] = None) -> dict[str, str]:
    """The sweep launcher's check of one job's composed config (`hydra.launcher.precheck`), before any job starts or
    the sweep's MLflow parent run opens: its rules (`relax.config.to_relax_config`, raising ConfigError), the
    addresses it must reach and what a single run checks before Ray (`SWEEP_CHECKS` of `relax.runner.preflight`),
    every problem in one RunError. Returns what the job needs to itself: its checkpoint directory, when it saves or
    resumes (the launcher refuses two jobs with the same one). `overrides`: the job's own command line (Hydra's
    syntax), read as the job reads it (`to_relax_config`): an evaluation-only job of a run's saved config (`-cp
    <checkpoint> -cn config train.num_rollout=0`) leaves the run's saving options it does not set aside.

    The input checks (tokenizer, data, ...) of jobs that differ only in their seed and tracking fields are run once
    per sweep (`tracking.sweep_id`): a sweep over seeds reads and tokenizes its data once, not once per job.

    The note of such a job on the saving options it leaves aside is the job's own to print, as a single run's is
    (`relax.cli.train._run`, in the job's output): this check, before any job starts, prints none."""
    cfg = to_relax_config(dc, overrides=overrides, note=False)
    found_unreachable = unreachable_endpoints(endpoint_targets(cfg))
    # the tracking store as the endpoints check marks it (`Endpoint.tracking_store`), whatever its message says
    store = next((u.message for u in found_unreachable if u.endpoint.tracking_store), None)
    problems = [u.message for u in found_unreachable if not u.endpoint.tracking_store]
    sweep_id = cfg.tracking.sweep_id
    key = (str(sweep_id), repr(dataclasses.replace(cfg, seed=0, tracking=TrackingConfig())))
    inputs = [c for c in SWEEP_CHECKS if c in INPUT_CHECKS]
    cached = _INPUTS_CHECKED.get(key) if sweep_id else None
    checks = [c for c in SWEEP_CHECKS if c not in inputs] if cached is not None else list(SWEEP_CHECKS)
    pre = preflight(cfg, only=checks, hash_checkpoints=False)
    found = dict(cached or {})
    found.update(pre.problems)
    if sweep_id and cached is None:
        if any(k[0] != str(sweep_id) for k in _INPUTS_CHECKED):
            _INPUTS_CHECKED.clear()  # another sweep's
        _INPUTS_CHECKED[key] = {k: v for k, v in pre.problems.items() if k in inputs}
    problems += [text for name in SWEEP_CHECKS if (text := found.get(name)) is not None and text not in problems]
    if problems or store is not None:
        raise SweepJobError(problems, unreachable_store(store) if store is not None else None)
    ckpts = checkpoint.Checkpoints(cfg)
    return {"checkpoint directory": str(ckpts.save_dir)} if ckpts.uses_dir else {}
