"""Pure helpers of the sweep launcher: arm names, per-job overrides, the final table.

No Ray, Hydra or MLflow imports, so that they are cheap to import and easy to test.
"""


import math
import textwrap
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

ARM_EXCLUDED_KEYS = ("seed",)  # seeds are repetitions of one arm, never an arm of their own


def new_sweep_id() -> str:
    """A sortable, unique id (`20250101-120000-ab12cd`): newest sweeps sort last, collisions need the same second."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def split_override(override: str) -> tuple[str, str]:
    """`+algorithm.kl2_budget=0.02` -> ("algorithm.kl2_budget", "0.02"); a `~key` deletion has value ""."""
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def swept_keys(job_overrides: Sequence[Sequence[str]], exclude: Sequence[str] = ARM_EXCLUDED_KEYS) -> list[str]:
    """Keys whose value differs between jobs (or that only some jobs set), in first-seen order, minus `exclude`.

    A key given one value on the command line is the same in every job, so it names no arm.
    """
    order: list[str] = []
    values: dict[str, set[Optional[str]]] = {}
    per_job = [dict(split_override(o) for o in job) for job in job_overrides]
    for job in per_job:
        for key in job:
            if key not in values:
                order.append(key)
                values[key] = set()
    for job in per_job:
        for key in order:
            values[key].add(job.get(key))
    return [k for k in order if len(values[k]) > 1 and k not in exclude]


def derive_arms(job_overrides: Sequence[Sequence[str]],
                exclude: Sequence[str] = ARM_EXCLUDED_KEYS) -> list[Optional[str]]:
    """Each job's arm: its `key=value` for the swept keys other than the seed, joined with commas.

    `algorithm=rloo,grpo seed=1,2` gives `algorithm=rloo` / `algorithm=grpo`; a sweep over seeds only
    gives None (the run's arm then defaults to its algorithm name, see `standard_tags`).
    """
    keys = swept_keys(job_overrides, exclude)
    arms: list[Optional[str]] = []
    for job in job_overrides:
        values = dict(split_override(o) for o in job)
        parts = [f"{k}={values[k]}" for k in keys if k in values]
        arms.append(",".join(parts) or None)
    return arms


def quote(value: str) -> str:
    """A Hydra override value that stays one string: quoted, so that `,` `=` and spaces are not grammar."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def tracking_overrides(*, sweep_id: Optional[str], parent_run_id: Optional[str],
                       arm: Optional[str]) -> list[str]:
    """The overrides the launcher appends to a job so that its MLflow run joins the sweep."""
    out = []
    if parent_run_id:
        out.append(f"tracking.parent_run_id={quote(parent_run_id)}")
    if sweep_id:
        out.append(f"tracking.sweep_id={quote(sweep_id)}")
    if arm:
        out.append(f"tracking.arm={quote(arm)}")
    return out


@dataclass
class JobRow:
    """One line of the end-of-sweep table."""

    index: int
    overrides: str
    status: str  # FINISHED | FAILED | KILLED | NOT STARTED (never submitted: no process, no MLflow run)
    run_id: Optional[str] = None
    final_reward: Optional[float] = None
    seconds: Optional[float] = None
    error: Optional[str] = None
    override_list: tuple[str, ...] = ()  # `overrides` one by one (a quoted value may hold spaces); () : split it


def _job_overrides(row: JobRow) -> list[str]:
    return list(row.override_list) if row.override_list else row.overrides.split()


def format_table(rows: Sequence[JobRow], *, sweep_id: Optional[str] = None, parent_run_id: Optional[str] = None,
                 width: int = 100) -> str:
    """The table a sweep ends with: index, overrides, status, time, MLflow run id, final reward; then errors.

    The overrides column holds, in full, the overrides that differ between the jobs (the arm's keys and the seed:
    what tells two rows apart); those every job shares are said once above the table, wrapped at `width`. Jobs that
    all have the same overrides show them all."""
    ordered = sorted(rows, key=lambda r: r.index)
    per_job = [_job_overrides(r) for r in ordered]
    differing = set(swept_keys(per_job, exclude=()))
    common: list[str] = []
    if differing:
        for job in per_job:
            common += [o for o in job if split_override(o)[0] not in differing and o not in common]
    header = ("#", "overrides" if not common else "overrides (those that differ)", "status", "time", "mlflow run",
              "final reward")
    body = []
    for r, job in zip(ordered, per_job, strict=True):
        reward = "" if r.final_reward is None or math.isnan(r.final_reward) else f"{r.final_reward:.4f}"
        secs = "" if r.seconds is None else f"{r.seconds:.0f} s"
        shown = [o for o in job if split_override(o)[0] in differing] if differing else job
        body.append((str(r.index), " ".join(shown) or "-", r.status, secs, r.run_id or "-", reward))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    failed = sum(r.status != "FINISHED" for r in rows)
    title = f"Sweep {sweep_id or ''}: {len(rows) - failed} of {len(rows)} jobs finished".replace("  ", " ")
    if parent_run_id:
        title += f" (MLflow parent run {parent_run_id})"
    lines = [title]
    if common:
        lines += textwrap.wrap("overrides of every job: " + " ".join(common), width=width, subsequent_indent="  ",
                               break_long_words=False, break_on_hyphens=False)
    lines += [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*b) for b in body]
    for r in sorted(rows, key=lambda r: r.index):
        if r.error:
            first = r.error.strip().splitlines()
            lines.append(f"job {r.index} failed: " + ("\n    ".join(first[-12:]) if first else "(no message)"))
    return "\n".join(line.rstrip() for line in lines)
