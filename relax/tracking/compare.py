"""Compare the arms of an experiment from its MLflow runs: final values, spread over seeds, paired differences.

Layer 2 (tracking): MLflow, numpy and matplotlib only, imported lazily; no Ray, runner or backends.
`relax-compare` (relax/cli/compare.py) is the command line around `compare`.

Statistics, per metric:
- a run's *final value* is the mean of its last `last_k` logged steps (a single last step is noisy);
- per arm: mean and sample standard deviation (ddof=1) of the final values over seeds, and n;
- against a control arm: differences `arm - control` paired by the `seed` tag (same seed, same data
  order and initial weights, so most seed-to-seed noise cancels), their mean, and a 95% confidence
  interval of that mean. With n >= MIN_BOOTSTRAP_PAIRS (5) pairs: a percentile bootstrap (`n_boot`
  resamples of the pairs, numpy `default_rng(seed)`, so the interval is reproducible). With 2..4
  pairs a bootstrap can only resample a handful of numbers (its interval is about their range, too
  narrow), so the interval is Student's t: mean +- t_{0.975, n-1} * sd / sqrt(n), the t quantile
  computed here exactly (no scipy). With one pair there is no interval ("n too small").
Anything that makes a number weak (a metric missing from some runs, one seed, unpaired seeds) becomes a note line,
never an exception. A selection that can give no number at all is a `CompareError` (exit 2), raised before any file is
written or logged, so the outputs of an earlier comparison stay: a `--metrics` name that no selected run has (with
the close names they have), a `--by` key that no selected run has as a tag or param, or no finite value at all.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from relax.metrics import EVAL_PREFIX, EVAL_STEP_TAG, EVAL_STEP_WEIGHTS, RAW_REWARD
from relax.tracking.mlflow_run import (
    PARENT_RUN_ID_TAG,
    PREVIOUS_SWEEP_TAG,
    file_store_refused,
    quiet_mlflow_logging,
    resolve_tracking_uri,
)
from relax.tracking.params import TAG_ARM, TAG_SEED, TAG_SWEEP_ID

if TYPE_CHECKING:
    from mlflow import MlflowClient

DEFAULT_METRIC = RAW_REWARD
MIN_BOOTSTRAP_PAIRS = 5  # fewer pairs: Student t interval instead of the bootstrap
CI_BOOTSTRAP = "bootstrap"
CI_TOO_SMALL = "n too small"
COMPARE_TAG = "relax.compare"  # runs created by relax-compare itself (never selected as arms)
NO_VALUE = "(none)"


class CompareError(Exception):
    """A selection that matches nothing or names what does not exist: one message, exit 2."""


@dataclass
class RunData:
    """One training run as the comparison sees it."""

    run_id: str
    arm: str
    seed: Optional[str]
    history: dict[str, list[tuple[int, float]]]  # metric -> [(step, value)] sorted by step
    status: str = "FINISHED"
    parent_run_id: Optional[str] = None
    experiment_id: Optional[str] = None
    start_time: int = 0


@dataclass
class ArmStats:
    metric: str
    arm: str
    n: int
    mean: float
    std: float  # NaN with one seed
    seeds: list[str]
    finals: dict[str, float]  # seed (or run id when untagged) -> final value


@dataclass
class PairedDiff:
    metric: str
    arm: str
    control: str
    n_pairs: int
    mean: float
    ci_low: float  # NaN when n_pairs == 1
    ci_high: float
    seeds: list[str]
    ci_method: str = CI_BOOTSTRAP  # "bootstrap", "t, <dof> dof" or "n too small"


@dataclass
class Comparison:
    metrics: list[str]
    arms: list[str]
    control: Optional[str]
    last_k: int
    n_boot: int
    stats: list[ArmStats] = field(default_factory=list)
    diffs: list[PairedDiff] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    runs: list[RunData] = field(default_factory=list)


# ---------------------------------------------------------------------- statistics
def final_value(history: Sequence[tuple[int, float]], last_k: int) -> float:
    """Mean of the values at the last `last_k` steps (all steps when fewer); NaN for an empty history."""
    finite = [(s, v) for s, v in history if v is not None and math.isfinite(v)]
    if not finite:
        return float("nan")
    tail = sorted(finite)[-max(1, last_k):]
    return sum(v for _, v in tail) / len(tail)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; NaN for fewer than two values)."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def bootstrap_ci(values: Sequence[float], *, n_boot: int = 10_000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (resampled with replacement, reproducible)."""
    import numpy as np

    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan")
    if x.size == 1 or n_boot < 1:
        return float(x.mean()), float(x.mean())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    means = x[idx].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


def t_two_sided_probability(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with `dof` (a positive integer) degrees of freedom.

    Exact finite sums of Abramowitz & Stegun 26.7.3 (odd dof) and 26.7.4 (even dof) in
    theta = atan(t / sqrt(dof)); no special functions needed.
    """
    if dof < 1:
        raise ValueError(f"dof must be >= 1, got {dof}")
    if t <= 0:
        return 0.0
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(dof))
    s, c = math.sin(theta), math.cos(theta)
    if dof % 2 == 1:
        total, term = 0.0, c  # c + (2/3) c^3 + (2*4)/(3*5) c^5 + ... up to c^(dof-2)
        for k in range(1, (dof - 1) // 2 + 1):
            total += term
            term *= (2 * k) / (2 * k + 1) * c * c
        return min(1.0, 2.0 / math.pi * (theta + s * total))
    total, term = 0.0, 1.0  # 1 + (1/2) c^2 + (1*3)/(2*4) c^4 + ... up to c^(dof-2)
    for k in range(1, dof // 2 + 1):
        total += term
        term *= (2 * k - 1) / (2 * k) * c * c
    return min(1.0, s * total)


def t_quantile(level: float, dof: int) -> float:
    """The two-sided critical value t with P(|T| <= t) = `level` (t_{0.975, dof} for level 0.95), by bisection."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    lo, hi = 0.0, 1.0
    while t_two_sided_probability(hi, dof) < level:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_two_sided_probability(mid, dof) < level:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


def t_interval(values: Sequence[float], *, level: float = 0.95) -> tuple[float, float]:
    """Student t interval of the mean: mean +- t_{(1+level)/2, n-1} * sd / sqrt(n); NaNs for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return float("nan"), float("nan")
    mean, sd = mean_std(values)
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


def paired_interval(diffs: Sequence[float], *, n_boot: int = 10_000, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float, str]:
    """The interval of the mean paired difference and how it was made (see the module docstring)."""
    n = len(diffs)
    if n < 2:
        return float("nan"), float("nan"), CI_TOO_SMALL
    if n < MIN_BOOTSTRAP_PAIRS:
        lo, hi = t_interval(diffs, level=level)
        return lo, hi, f"t, {n - 1} dof"
    lo, hi = bootstrap_ci(diffs, n_boot=n_boot, seed=seed, level=level)
    return lo, hi, CI_BOOTSTRAP


def _seed_key(run: RunData) -> str:
    return run.seed if run.seed is not None else f"run:{run.run_id[:8]}"


def _spelling(arm: str) -> str:
    """An arm's `key=value` parts with booleans and null spelled one way: a sweep's arm tags carry Hydra's parsed
    values (`rollout.routing_replay=False`), a user types what they launched (`...=false`)."""
    parts = []
    for part in arm.split(","):
        key, eq, value = part.partition("=")
        if eq and value.lower() in ("true", "false", "none", "null"):
            value = "null" if value.lower() in ("none", "null") else value.lower()
        parts.append(key + eq + value)
    return ",".join(parts)


def resolve_control(control: Optional[str], arms: Sequence[str]) -> Optional[str]:
    """`control` as one of `arms`: itself, or the one arm it names with booleans or null spelled otherwise."""
    if control is None or control in arms:
        return control
    same = [a for a in arms if _spelling(a) == _spelling(control)]
    return same[0] if len(same) == 1 else control


def summarize(runs: Sequence[RunData], metrics: Sequence[str], *, control: Optional[str] = None, last_k: int = 10,
              n_boot: int = 10_000, seed: int = 0) -> Comparison:
    """Per-arm statistics and paired differences to `control` for each metric; problems become notes."""
    arms = sorted({r.arm for r in runs})
    control = resolve_control(control, arms)
    if control is not None and control not in arms:
        raise CompareError(f"control arm {control!r} is not among the arms: {', '.join(arms) or '(no runs)'}")
    comp = Comparison(list(metrics), arms, control, last_k, n_boot, runs=list(runs))
    by_arm: dict[str, list[RunData]] = {a: [] for a in arms}
    for r in sorted(runs, key=lambda r: r.start_time):
        by_arm[r.arm].append(r)
    for arm, members in by_arm.items():
        seeds = [r.seed for r in members]
        if any(s is None for s in seeds):
            comp.notes.append(f"arm {arm}: {sum(s is None for s in seeds)} run(s) without a seed tag: "
                              "kept in the arm's statistics, left out of paired differences")
        dupes = sorted({s for s in seeds if s is not None and seeds.count(s) > 1})
        if dupes:
            comp.notes.append(f"arm {arm}: several runs with seed {', '.join(dupes)}: the most recent one is used")
    for metric in metrics:
        finals_by_arm: dict[str, dict[str, float]] = {}
        for arm in arms:
            finals: dict[str, float] = {}
            missing = []
            for r in by_arm[arm]:
                value = final_value(r.history.get(metric, []), last_k)
                if math.isnan(value):
                    missing.append(_seed_key(r))
                    continue
                finals[_seed_key(r)] = value  # later runs (same seed) replace earlier ones
            if missing:
                comp.notes.append(f"{metric}: arm {arm} has no values for seed(s) "
                                  f"{', '.join(sorted(missing, key=_natural))}")
            finals_by_arm[arm] = finals
            mean, std = mean_std(list(finals.values()))
            if len(finals) == 1:
                comp.notes.append(f"{metric}: arm {arm} has a single seed: no spread, and any difference is anecdotal")
            if finals:
                comp.stats.append(ArmStats(metric, arm, len(finals), mean, std, sorted(finals, key=_natural),
                                           finals))
        if control is None:
            continue
        base = finals_by_arm.get(control, {})
        if not base:
            comp.notes.append(f"{metric}: the control arm {control} has no values: no paired differences")
            continue
        for arm in arms:
            if arm == control:
                continue
            mine = finals_by_arm.get(arm, {})
            common = sorted((set(mine) & set(base)) - {k for k in mine if k.startswith("run:")}, key=_natural)
            only_arm = sorted(set(mine) - set(base), key=_natural)
            only_ctrl = sorted(set(base) - set(mine), key=_natural)
            if only_arm or only_ctrl:
                parts = []
                if only_arm:
                    parts.append(f"{', '.join(only_arm)} only in {arm}")
                if only_ctrl:
                    parts.append(f"{', '.join(only_ctrl)} only in {control}")
                comp.notes.append(f"{metric}: arms {arm} and {control} have different seed sets "
                                  f"({'; '.join(parts)}): unpaired seeds are left out of the difference")
            if not common:
                comp.notes.append(f"{metric}: arm {arm} shares no seed with {control}: no paired difference")
                continue
            diffs = [mine[s] - base[s] for s in common]
            lo, hi, how = paired_interval(diffs, n_boot=n_boot, seed=seed)
            if len(diffs) == 1:
                comp.notes.append(f"{metric}: {arm} vs {control} has one pair: n too small for an interval")
            comp.diffs.append(PairedDiff(metric, arm, control, len(diffs), sum(diffs) / len(diffs), lo, hi, common,
                                         how))
    return comp


def _natural(key: str) -> tuple[int, Any]:
    try:
        return (0, float(key))
    except ValueError:
        return (1, key)


# ---------------------------------------------------------------------- selection
def most_recent_sweep(client: MlflowClient, experiment_ids: Sequence[str]) -> Optional[str]:
    """The sweep_id of the most recently started run that has one, or None."""
    found = client.search_runs(list(experiment_ids), filter_string=f"tags.{TAG_SWEEP_ID} LIKE '%'",
                               max_results=1, order_by=["attributes.start_time DESC"])
    return found[0].data.tags.get(TAG_SWEEP_ID) if found else None


def _experiment_ids(client: MlflowClient, experiment: Optional[str]) -> list[str]:
    if experiment is None:
        return [e.experiment_id for e in client.search_experiments()]
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = ", ".join(sorted(e.name for e in client.search_experiments())) or "none"
        raise CompareError(f"no MLflow experiment named {experiment!r} (experiments: {names})")
    return [exp.experiment_id]


def _quote(value: str) -> str:
    return "'" + value.replace("'", "\\'") + "'"


def select_runs(client: MlflowClient, *, experiment: Optional[str] = None, sweep: Optional[str] = None,
                tags: Mapping[str, str] = {}, run_ids: Sequence[str] = ()  # noqa: B006
                ) -> tuple[list[Any], str, Optional[str]]:
    """MLflow runs to compare, a description of the selection and the sweep id (found when none is given).

    No selector: the most recent sweep. A sweep's parent run and relax-compare's own runs are never
    arms; runs that did not finish are left out (see `load_runs`).
    """
    if run_ids:
        runs = [client.get_run(r) for r in run_ids]
        return runs, f"runs {', '.join(run_ids)}", None
    exp_ids = _experiment_ids(client, experiment)
    if not exp_ids:
        raise CompareError("the tracking store has no experiments")
    if sweep is None and not tags and experiment is None:
        sweep = most_recent_sweep(client, exp_ids)
        if sweep is None:
            raise CompareError("no sweep in this tracking store; select runs with --experiment, --tag or --run-ids")
    clauses = []
    if sweep is not None:
        clauses.append(f"tags.{TAG_SWEEP_ID} = {_quote(sweep)}")
    for k, v in tags.items():
        clauses.append(f"tags.`{k}` = {_quote(v)}")
    runs: list[Any] = []
    token = None
    while True:
        page = client.search_runs(exp_ids, filter_string=" AND ".join(clauses), max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    parents = {r.data.tags.get(PARENT_RUN_ID_TAG) for r in runs}
    runs = [r for r in runs if r.info.run_id not in parents and COMPARE_TAG not in r.data.tags
            and not (sweep is not None and PARENT_RUN_ID_TAG not in r.data.tags and TAG_SEED not in r.data.tags)]
    parts = []
    if experiment:
        parts.append(f"experiment {experiment}")
    if sweep:
        parts.append(f"sweep {sweep}")
    parts += [f"{k}={v}" for k, v in tags.items()]
    if not runs:
        raise CompareError(f"no runs match {' and '.join(parts)}" + _continued_by(client, exp_ids, sweep))
    return runs, " and ".join(parts), sweep


def _continued_by(client: MlflowClient, exp_ids: Sequence[str], sweep: Optional[str]) -> str:
    """For a sweep whose runs were all resumed by a later sweep (they moved to its parent run): which one."""
    if sweep is None:
        return ""
    moved = client.search_runs(list(exp_ids), filter_string=f"tags.`{PREVIOUS_SWEEP_TAG}` = {_quote(sweep)}",
                               max_results=1000)
    later = sorted({r.data.tags.get(TAG_SWEEP_ID) for r in moved} - {None, sweep})
    if not later:
        return ""
    return (f": its runs were resumed by sweep {', '.join(later)} (relax-train -m ... train.resume=...), which they "
            f"belong to now; compare them with --sweep {later[-1]}")


def _group_value(run: Any, by: str) -> Optional[str]:
    tags, params = run.data.tags, run.data.params
    if by in tags:
        return tags[by]
    if by in params:
        return params[by]
    return None


def _did_you_mean(name: str, choices: set[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(choices), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def _metrics_they_have(present: set[str]) -> str:
    shown = sorted(present)
    more = f", ... {len(shown) - 40} more" if len(shown) > 40 else ""
    return f"metrics they have: {', '.join(shown[:40]) + more}" if shown else "they have no metrics"


def _keys_they_have(runs: Sequence[Any], by: str) -> str:
    """The tags (MLflow's own left out) and params the runs have, for a --by that names none of them."""
    tags = sorted({k for r in runs for k in r.data.tags if not k.startswith("mlflow.")})
    params = sorted({k for r in runs for k in r.data.params})
    hint = _did_you_mean(by, set(tags) | set(params))
    shown = ", ".join(params[:12]) + (f", ... {len(params) - 12} more" if len(params) > 12 else "")
    return f"{hint.strip()} tags they have: {', '.join(tags) or 'none'}; params: {shown or 'none'}".lstrip()


def load_runs(client: MlflowClient, runs: Sequence[Any], *, by: str = TAG_ARM, metrics: Optional[Sequence[str]] = None,
              include_unfinished: bool = False) -> tuple[list[RunData], list[str], list[str]]:
    """Histories of the chosen metrics (default: rollout/raw_reward and every eval/* present), runs and notes."""
    notes: list[str] = []
    kept = []
    for r in runs:
        if r.info.status != "FINISHED" and not include_unfinished:
            notes.append(f"run {r.info.run_id} ({by}={_group_value(r, by)}, seed {r.data.tags.get(TAG_SEED)}) is "
                         f"{r.info.status}: left out (--include-unfinished keeps it)")
            continue
        kept.append(r)
    present = {k for r in kept for k in r.data.metrics}
    if metrics is None:
        metrics = [DEFAULT_METRIC] + sorted(k for k in present if k.startswith(EVAL_PREFIX))
        if kept and DEFAULT_METRIC not in present and len(metrics) == 1:
            raise CompareError(f"the selected runs have no {DEFAULT_METRIC} and no {EVAL_PREFIX}* metric; "
                               f"name the metrics with --metrics ({_metrics_they_have(present)})")
    elif kept:
        absent = [m for m in metrics if m not in present]
        if absent:
            raise CompareError("; ".join(f"metric {m!r} is in none of the {len(kept)} selected runs"
                                         f"{_did_you_mean(m, present)}" for m in absent)
                               + f" ({_metrics_they_have(present)})")
    for m in metrics:
        if kept and m not in present:
            notes.append(f"metric {m} is in none of the selected runs")
    if kept and not any(_group_value(r, by) is not None for r in kept):
        raise CompareError(f"--by {by}: none of the {len(kept)} selected runs has a tag or param {by!r} "
                           f"({_keys_they_have(kept, by)})")
    out = []
    for r in kept:
        arm = _group_value(r, by)
        if arm is None:
            notes.append(f"run {r.info.run_id} has no tag or param {by!r}: grouped as {NO_VALUE}")
            arm = NO_VALUE
        history = {}
        for m in metrics:
            if m in r.data.metrics:
                history[m] = sorted((h.step, h.value) for h in client.get_metric_history(r.info.run_id, m))
        out.append(RunData(r.info.run_id, arm, r.data.tags.get(TAG_SEED), history, r.info.status,
                           r.data.tags.get(PARENT_RUN_ID_TAG), r.info.experiment_id, r.info.start_time or 0))
    notes += _eval_step_notes(kept, metrics, by)
    return out, list(metrics), notes


def _eval_step_notes(runs: Sequence[Any], metrics: Sequence[str], by: str) -> list[str]:
    """A note when the selected runs logged their evaluations at different steps: runs without the tag
    EVAL_STEP_TAG (made by a Relax before it) logged the evaluation after 0-based step s at step s, the others at
    s + 1, the number of training steps in the weights evaluated; steps are compared as logged, not moved."""
    if not any(m.startswith(EVAL_PREFIX) for m in metrics):
        return []
    evaluated = [r for r in runs if any(k.startswith(EVAL_PREFIX) for k in r.data.metrics)]
    older = [r for r in evaluated if r.data.tags.get(EVAL_STEP_TAG) != EVAL_STEP_WEIGHTS]
    if not older or len(older) == len(evaluated):
        return []
    named = "; ".join(f"{r.info.run_id} ({by}={_group_value(r, by)}, seed {r.data.tags.get(TAG_SEED)}, "
                      f"{EVAL_STEP_TAG}: {r.data.tags.get(EVAL_STEP_TAG, 'none')})" for r in older)
    return [f"eval/* of runs made before Relax logged an evaluation at the number of training steps in the weights "
            f"(tag {EVAL_STEP_TAG}={EVAL_STEP_WEIGHTS}) sit one step early against the other runs' (the evaluation "
            f"after 0-based step s at s, not s + 1; docs/training.md, \"Evaluation\"): {named}"]


# ---------------------------------------------------------------------- output
def _fmt(x: float, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:+.4f}" if signed else f"{x:.4f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip(),
            *(fmt.format(*r).rstrip() for r in rows)]


def render(comp: Comparison, *, title: str = "") -> str:
    """The terminal report: one table per metric (arms), the paired differences, then the notes."""
    lines = [title] if title else []
    for metric in comp.metrics:
        stats = [s for s in comp.stats if s.metric == metric]
        lines.append("")
        lines.append(f"{metric}: final value = mean of the last {comp.last_k} steps; mean and std over seeds")
        rows = [(s.arm + (" (control)" if s.arm == comp.control else ""), str(s.n), _fmt(s.mean), _fmt(s.std),
                 ",".join(s.seeds)) for s in stats]
        lines += ["  " + x for x in _table(("arm", "n seeds", "mean", "std", "seeds"), rows)] if rows else \
            ["  (no values)"]
        diffs = [d for d in comp.diffs if d.metric == metric]
        if diffs:
            lines.append(f"  paired by seed vs control {comp.control}: mean difference and 95% CI (Student t with "
                         f"n-1 dof below {MIN_BOOTSTRAP_PAIRS} pairs, else percentile bootstrap of {comp.n_boot} "
                         "resamples)")
            rows = [(d.arm, str(d.n_pairs), _fmt(d.mean, True), _fmt(d.ci_low, True), _fmt(d.ci_high, True),
                     d.ci_method, ",".join(d.seeds)) for d in diffs]
            lines += ["  " + x for x in _table(("arm", "n pairs", "diff", "ci low", "ci high", "interval", "seeds"),
                                               rows)]
    if comp.notes:
        lines.append("")
        lines += [f"note: {n}" for n in comp.notes]
    return "\n".join(lines)


def _csv_num(x: float) -> str:
    return "" if math.isnan(x) else f"{x:.6g}"


def write_csv(comp: Comparison, path: Path) -> Path:
    """One row per (metric, arm): n, mean, std, seeds, per-seed finals, and the paired difference to the control."""
    path.parent.mkdir(parents=True, exist_ok=True)
    diffs = {(d.metric, d.arm): d for d in comp.diffs}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["metric", "arm", "is_control", "n_seeds", "mean", "std", "seeds", "finals", "last_k",
                    "control", "n_pairs", "diff_mean", "diff_ci_low", "diff_ci_high", "diff_ci_method"])
        for s in comp.stats:
            d = diffs.get((s.metric, s.arm))
            finals = ";".join(f"{k}={s.finals[k]:.6g}" for k in s.seeds)
            w.writerow([s.metric, s.arm, s.arm == comp.control, s.n, f"{s.mean:.6g}",
                        "" if math.isnan(s.std) else f"{s.std:.6g}", ";".join(s.seeds), finals, comp.last_k,
                        comp.control or "", d.n_pairs if d else "", f"{d.mean:.6g}" if d else "",
                        _csv_num(d.ci_low) if d else "", _csv_num(d.ci_high) if d else "",
                        d.ci_method if d else ""])
    return path


def plot_curves(comp: Comparison, path: Path, *, band: str = "minmax", title: str = "") -> Path:
    """Learning curves: per arm the mean over seeds at each step, shaded min..max (or +-std) over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    metrics = comp.metrics or [DEFAULT_METRIC]
    ncols = min(3, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(metrics):]:
        ax.set_visible(False)
    for ax, metric in zip(axes.flat, metrics, strict=False):
        for arm in comp.arms:
            per_step: dict[int, list[float]] = {}
            for r in comp.runs:
                if r.arm == arm:
                    for step, value in r.history.get(metric, []):
                        if math.isfinite(value):
                            per_step.setdefault(step, []).append(value)
            if not per_step:
                continue
            steps = np.array(sorted(per_step))
            vals = [np.array(per_step[s]) for s in steps]
            mean = np.array([v.mean() for v in vals])
            if band == "std":
                sd = np.array([v.std(ddof=1) if v.size > 1 else 0.0 for v in vals])
                lo, hi = mean - sd, mean + sd
            else:
                lo, hi = np.array([v.min() for v in vals]), np.array([v.max() for v in vals])
            label = arm + (" (control)" if arm == comp.control else "")
            (line,) = ax.plot(steps, mean, label=label, linewidth=1.6)
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    what = "min..max" if band != "std" else "+-1 std"
    fig.suptitle((title + "\n" if title else "") + f"mean over seeds, band = {what}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- the whole command
@dataclass
class CompareResult:
    comparison: Comparison
    text: str
    csv_path: Path
    png_path: Path
    logged_to: Optional[str]  # MLflow run id the files were logged to


def log_outputs(client: MlflowClient, runs: Sequence[RunData], files: Sequence[Path], *,
                description: str) -> Optional[str]:
    """Log the files to the sweep's parent run (all runs share one), else to a new `relax-compare` run."""
    parents = {r.parent_run_id for r in runs}
    if len(parents) == 1 and None not in parents:
        target = parents.pop()
    else:
        exp_ids = {r.experiment_id for r in runs}
        exp_id = exp_ids.pop() if len(exp_ids) == 1 else runs[0].experiment_id
        run = client.create_run(exp_id, run_name=f"compare-{time.strftime('%Y%m%d-%H%M%S')}",
                                tags={COMPARE_TAG: "true", "relax.compare.selection": description[:5000]})
        target = run.info.run_id
        client.set_terminated(target, "FINISHED")
    for f in files:
        client.log_artifact(target, str(f), artifact_path="compare")
    return target


def compare(*, uri: str = "sqlite:///mlflow.db", experiment: Optional[str] = None, sweep: Optional[str] = None,
            tags: Mapping[str, str] = {}, run_ids: Sequence[str] = (),  # noqa: B006
            by: str = TAG_ARM, metrics: Optional[Sequence[str]] = None, last_k: int = 10,
            control: Optional[str] = None, n_boot: int = 10_000, seed: int = 0, band: str = "minmax",
            out_dir: Optional[Path] = None, log: bool = True, include_unfinished: bool = False) -> CompareResult:
    """Select runs, compute the statistics, write the CSV and PNG, log them to MLflow; returns what it did."""
    import os
    import warnings

    quiet_mlflow_logging()
    from mlflow import MlflowClient

    uri = resolve_tracking_uri(uri)
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):].partition("?")[0]):
        raise CompareError(f"no tracking store at {uri} (run from the directory of your runs, or pass --uri)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            client = MlflowClient(tracking_uri=uri)
        except Exception as exc:
            if (refused := file_store_refused(uri, exc)) is not None:
                raise CompareError(refused) from None
            raise
        raw, description, sweep = select_runs(client, experiment=experiment, sweep=sweep, tags=tags, run_ids=run_ids)
    runs, metric_list, notes = load_runs(client, raw, by=by, metrics=metrics, include_unfinished=include_unfinished)
    if not runs:
        raise CompareError(f"no finished runs in {description}")
    comp = summarize(runs, metric_list, control=control, last_k=last_k, n_boot=n_boot, seed=seed)
    comp.notes[:0] = notes
    if not comp.stats:  # nothing to write: the outputs of an earlier comparison stay as they are
        raise CompareError(f"no finite values of {', '.join(metric_list)} in the {len(runs)} selected runs of "
                           f"{description}")
    title = f"relax-compare: {len(runs)} runs of {description}, grouped by {by} ({uri})"
    name = sweep or time.strftime("%Y%m%d-%H%M%S")
    out = out_dir or Path("compare") / name.replace("/", "_").replace(" ", "_")
    csv_path = write_csv(comp, out / "compare.csv")
    png_path = plot_curves(comp, out / "compare.png", band=band, title=description)
    logged = None
    if log:
        try:
            logged = log_outputs(client, runs, [csv_path, png_path], description=description)
        except Exception as exc:  # noqa: BLE001 - the local files are still there
            comp.notes.append(f"could not log the CSV and PNG to MLflow: {exc}")
    text = render(comp, title=title)
    return CompareResult(comp, text, csv_path, png_path, logged)
