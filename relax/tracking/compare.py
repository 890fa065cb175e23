"""Compare the arms of an experiment from its MLflow runs: final values, spread over seeds, paired differences.

Layer 2 (tracking): MLflow, numpy and matplotlib only, imported lazily; no Ray, runner or backends.
`relax-compare` (relax/cli/compare.py) is the command line around `compare`.

Runs: one per (arm, seed), the same for every metric (`choose_runs`: the most recent finished one; a note names the
others). Runs of one arm must be of one config (outside the seed, train.resume, tracking.* and what a resume may
change): runs of different configs under one arm label are a CompareError naming the params and the `--by` that
separates them (`config_conflicts`), never a rerun dropped or seeds averaged. Evaluation-only runs
(train.num_rollout=0) selected with training runs form arms of their own; those of one arm may differ in the weights
they evaluate only as the exports of one training arm (one `arm` tag). The params that differ between arms are
listed, and an arm whose runs differ in what a resume may change (train.num_rollout, ...) gets a note.

Statistics, per metric:
- a run's *final value* is the mean of its last `last_k` logged values (a single step's training reward is noisy);
  for an eval/* metric, of its last `eval_last_k` evaluations (default 1: the evaluation of the final weights, as
  an evaluation already averages over its prompts and earlier ones are of earlier weights);
- per arm: mean and sample standard deviation (ddof=1) of the final values over seeds, and n;
- against a control arm: differences `arm - control` paired by the `seed` tag (same seed, same data
  order and initial weights, so most seed-to-seed noise cancels), their mean, and a 95% confidence
  interval of that mean. With n >= MIN_BOOTSTRAP_PAIRS (5) pairs: a percentile bootstrap (`n_boot`
  resamples of the pairs, numpy `default_rng(seed)`, so the interval is reproducible). With 2..4
  pairs a bootstrap can only resample a handful of numbers (its interval is about their range, too
  narrow), so the interval is Student's t: mean +- t_{0.975, n-1} * sd / sqrt(n), the t quantile
  computed here exactly (no scipy). With one pair there is no interval ("n too small"). A verdict says in words
  whether the interval leaves out 0; several arms against one control get a note on multiple comparisons.
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
from relax.tracking.params import RESUMABLE_CHANGES, TAG_ARM, TAG_SEED, TAG_SWEEP_ID
from relax.tracking.progress import steps_name

if TYPE_CHECKING:
    from mlflow import MlflowClient

DEFAULT_METRIC = RAW_REWARD
MIN_BOOTSTRAP_PAIRS = 5  # fewer pairs: Student t interval instead of the bootstrap
CI_BOOTSTRAP = "bootstrap"
CI_TOO_SMALL = "n too small"
COMPARE_TAG = "relax.compare"  # runs created by relax-compare itself (never selected as arms)
# on every sweep's parent run, whatever became of its jobs: the launcher's table of their statuses (JOBS_TAG of
# hydra_plugins/relax_ray_launcher/launcher.py, which this layer does not import), set when the sweep ends, Ctrl-C too
SWEEP_PARENT_TAG = "relax.sweep_jobs"
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
    params: dict[str, str] = field(default_factory=dict)  # the run's config, as MLflow params
    # its `arm` tag, whatever `--by` groups by: the training arm whose weights an evaluation-only run evaluates
    arm_tag: Optional[str] = None


@dataclass
class ArmStats:
    metric: str
    arm: str
    n: int
    mean: float
    std: float  # NaN with one seed
    seeds: list[str]
    finals: dict[str, float]  # seed (or run id when untagged) -> final value
    tails: dict[str, list[int]] = field(default_factory=dict)  # seed -> the steps its final value is the mean of


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

    @property
    def verdict(self) -> str:
        """What the interval says, in words: a difference shown only when the 95% CI leaves 0 out."""
        if math.isnan(self.ci_low) or math.isnan(self.ci_high):
            return "no interval (one pair): no conclusion"
        if self.ci_low > 0:
            return f"CI above 0: {self.arm} higher than {self.control}"
        if self.ci_high < 0:
            return f"CI below 0: {self.arm} lower than {self.control}"
        return "CI contains 0: no difference shown"


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
    runs: list[RunData] = field(default_factory=list)  # one per (arm, seed): the runs the numbers come from
    eval_last_k: int = 1
    config_diff: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # param -> arm -> value(s)
    # a note that says the same of several arms: its text -> (its form in ARM_NOTES, the fields besides its arm and
    # metric, its arm), so that the report writes it once for all of them (`_merged_notes`)
    note_forms: dict[str, tuple[str, tuple[tuple[str, str], ...], str]] = field(default_factory=dict)

    def arm_note(self, form: str, metric: str, arm: str, **fields: str) -> None:
        """Add the note `form` of ARM_NOTES about `arm` (and `metric`), as its text for one arm."""
        text = f"{metric}: " + ARM_NOTES[form][0].format(arm=arm, **fields)
        self.notes.append(text)
        self.note_forms[text] = (form, tuple(sorted(fields.items())), arm)

    def k_for(self, metric: str) -> int:
        """How many last values make a run's final value of `metric`."""
        return self.eval_last_k if metric.startswith(EVAL_PREFIX) else self.last_k


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


EVAL_ONLY_SUFFIX = " (evaluation-only)"
# params that differ from run to run by design, never a config difference: the seed, where a run resumes from, and
# tracking.* (run name, sweep and parent ids, the arm label itself)
RUN_SPECIFIC_PARAMS = ("seed", "train.resume")
RUN_SPECIFIC_PREFIXES = ("tracking.",)
# what an evaluation-only run of exported weights sets to the weights it evaluates (`model.source=hf
# model.path=<export> train.num_rollout=0`, docs/training.md "Evaluation only"): each seed's export is a directory of
# its own, so the evaluation-only runs of one arm may differ there (its config note still names them)
EVAL_ONLY_WEIGHTS_PARAMS = ("model.source", "model.path")
NOT_LOGGED = "(not logged)"
CONFIG_DIFF_SHOWN = 15  # params listed in the "config" section; the rest are counted
# the "config" table has a column per arm while it fits this width, else (many arms) a row per arm if that is narrower
CONFIG_TABLE_WIDTH = 120
# notes that can say the same of several arms: (the text for one arm, for several: `{arms}` is "3 arms (a, b, c)" or
# "all 9 arms", the arms of the comparison, or of those with a control, the arms besides it)
ARM_NOTES = {
    "single_seed": ("arm {arm} has a single seed: no spread, and any difference is anecdotal",
                    "{arms} have a single seed each: no spread, and any difference is anecdotal"),
    "one_pair": ("{arm} vs {control} has one pair: n too small for an interval",
                 "{arms} vs {control} have one pair each: n too small for an interval"),
    "no_values": ("arm {arm} has no values for seed(s) {seeds}", "{arms} have no values for seed(s) {seeds}"),
    "no_shared_seed": ("arm {arm} shares no seed with {control}: no paired difference",
                       "{arms} share no seed with {control}: no paired difference"),
}


def _when(run: RunData) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(run.start_time / 1000)) if run.start_time else "?"


def _who(run: RunData) -> str:
    return f"{run.arm}/seed {run.seed}" if run.seed is not None else f"{run.arm}/run {run.run_id[:8]}"


def choose_runs(runs: Sequence[RunData]) -> tuple[list[RunData], list[str]]:
    """One run per (arm, seed), the same for every metric: the most recently started FINISHED one (the most recent
    of any status when none finished, with --include-unfinished); a note names the runs left out, and one the chosen
    runs that did not finish."""
    groups: dict[tuple[str, str], list[RunData]] = {}
    for r in runs:
        groups.setdefault((r.arm, _seed_key(r)), []).append(r)
    chosen, notes = [], []
    for (arm, key), members in groups.items():
        members.sort(key=lambda r: (r.status == "FINISHED", r.start_time), reverse=True)
        chosen.append(members[0])
        if len(members) > 1:
            used = members[0]
            which = "most recent finished" if used.status == "FINISHED" else "most recent"
            notes.append(f"arm {arm}: {len(members)} runs with seed {key}: every metric of that seed comes from the "
                         f"{which} one, {used.run_id} (started {_when(used)}); left out: "
                         + ", ".join(f"{m.run_id} ({m.status}, started {_when(m)})" for m in members[1:]))
    chosen.sort(key=lambda r: r.start_time)
    unfinished = [r for r in chosen if r.status != "FINISHED"]  # kept by --include-unfinished
    if unfinished:
        notes.append(f"{len(unfinished)} run(s) did not finish (--include-unfinished): their final values are where "
                     "they stopped: " + ", ".join(f"{r.run_id} ({_who(r)}, {r.status}, last step "
                                                  f"{max((h[-1][0] for h in r.history.values() if h), default='-')})"
                                                  for r in unfinished))
    return chosen, notes


def _evaluation_only(params: Mapping[str, str]) -> bool:
    """A run that trained nothing and evaluated its starting weights (`train.num_rollout=0`)."""
    return params.get("train.num_rollout") == "0"


def _rerun_may_differ(key: str) -> bool:
    """`key` may differ between runs of one config: run-specific (seed, train.resume, tracking.*) or a field a resume
    may change (RESUMABLE_CHANGES, or a leaf of one such as `data.eval_sets.<name>`)."""
    return (key in RUN_SPECIFIC_PARAMS or key.startswith(RUN_SPECIFIC_PREFIXES) or key in RESUMABLE_CHANGES
            or any(key.startswith(f + ".") for f in RESUMABLE_CHANGES))


def config_conflicts(runs: Sequence[RunData], by: str | Sequence[str] = TAG_ARM) -> None:
    """A CompareError when the runs of one arm differ in a param that a rerun or a resume of one config cannot
    change: such runs are different experiments that share an arm label (the default arm is the algorithm's name, so
    a LoRA run and a full fine-tune both have `grpo`), and one seed of them would keep the newest as a rerun and drop
    the others, or seeds of different configs would be averaged as seed noise. The error names the params, each
    value with its runs, and the `--by` to type: every differing param (after the `by` keys themselves where the
    runs have several arms, which grouping by the params alone would merge). A param some runs did not log (another
    Relax version)
    is not a difference; differences in what may change (num_rollout, evaluation), and among evaluation-only runs
    the weights they evaluate (EVAL_ONLY_WEIGHTS_PARAMS: each seed's export), stay a note. That last holds only for
    evaluation-only runs of one `arm` tag (the exports of one training arm's seeds): a `--by` over params groups them
    by the evaluation's own config (its train.lr need not be its training arm's: it trains nothing), which may be
    the same for the evaluations of every training arm, whose weights are different experiments; the `--by` named
    then adds `arm`, which tells them apart."""
    by = by_keys(by)
    by_arm: dict[str, list[RunData]] = {}
    for r in runs:
        if r.params:
            by_arm.setdefault(r.arm, []).append(r)
    problems, splits, every = [], [], {}  # every: the params that differ within some arm, in order
    tags_apart = False  # some arm holds evaluations of the weights of several training arms (`arm` tags)
    for arm, members in sorted(by_arm.items()):
        if len(members) < 2:
            continue
        evaluations = all(_evaluation_only(m.params) for m in members)
        tagged = list(dict.fromkeys(m.arm_tag for m in members))
        weights = EVAL_ONLY_WEIGHTS_PARAMS if evaluations and len(tagged) == 1 else ()
        keys = sorted(k for k in set().union(*(m.params for m in members)) if not _rerun_may_differ(k)
                      and k not in weights and all(k in m.params for m in members))
        differing = [k for k in keys if len({m.params[k] for m in members}) > 1]
        if not differing:
            continue
        members = sorted(members, key=lambda m: (_natural(_seed_key(m)), m.start_time))

        def runs_with(k: str, v: Optional[str], members: list[RunData] = members) -> str:
            """The runs whose param `k` (or, for k=TAG_ARM, whose `arm` tag) is `v`."""
            return ", ".join(m.run_id + (f" seed {m.seed}" if m.seed is not None else "")
                             for m in members if (m.arm_tag if k == TAG_ARM else m.params[k]) == v)

        label = f"{by[0]} {arm}" if len(by) == 1 else f"arm {arm}"
        if evaluations and len(tagged) > 1:
            tags_apart = True
            splits.append((TAG_ARM, True))
            others = [k for k in differing if k not in EVAL_ONLY_WEIGHTS_PARAMS]  # also refused for one arm tag
            every.update(dict.fromkeys(others))
            text = "".join(f"; {k}: " + ", ".join(f"{_short(v)} [{runs_with(k, v)}]"
                                                  for v in dict.fromkeys(m.params[k] for m in members))
                           for k in others[:6])
            problems.append(f"{label}: {len(members)} evaluation-only runs of the weights of {len(tagged)} training "
                            f"arms, {TAG_ARM} tag " + ", ".join(f"{t} [{runs_with(TAG_ARM, t)}]"
                                                              for t in sorted(tagged, key=str)) + text)
            continue
        configs = len({tuple(m.params[k] for k in differing) for m in members})
        # the param that alone tells every config of the arm apart (the first), else the one with the most values
        best = sorted(differing, key=lambda k: -len({m.params[k] for m in members}))[0]
        splits.append((best, len({m.params[best] for m in members}) == configs))
        every.update(dict.fromkeys(differing))
        text = "; ".join(f"{k}: " + ", ".join(f"{_short(v)} [{runs_with(k, v)}]"
                                              for v in dict.fromkeys(m.params[k] for m in members))
                         for k in differing[:6])
        more = f"; ... {len(differing) - 6} more" if len(differing) > 6 else ""
        problems.append(f"{label}: {len(members)} runs of {configs} different configs: {text}{more}")
    if not problems:
        return
    several_arms = len({r.arm for r in runs}) > 1
    keys = [*(by if several_arms or tags_apart else ()), *(k for k in every if k not in by),
            *((TAG_ARM,) if tags_apart and TAG_ARM not in by else ())]
    how = f"compare them as arms with --by {','.join(keys)}"
    if len(keys) > 1 and not several_arms and splits[0][1]:
        how += f" ({splits[0][0]} alone also tells them apart: --by {splits[0][0]})"
    raise CompareError(
        "runs of different configs share an arm, so they are not seeds or reruns of one experiment (the default arm "
        "is the algorithm's name): " + "; ".join(problems) + ". Runs of one arm may differ only in the seed, "
        "train.resume, tracking.* and what a resume may change (train.num_rollout, evaluation and saving), and "
        "evaluation-only runs of one training arm (one arm tag) also in the weights they evaluate (model.source, "
        "model.path); "
        f"{how}, or select the runs of one config (--run-ids, --tag)")


def _short(value: str, limit: int = 40) -> str:
    return value if len(value) <= limit else value[:limit - 3] + "..."


def config_differences(runs: Sequence[RunData]) -> tuple[list[tuple[str, dict[str, str]]], list[str]]:
    """The params (the runs' configs) that differ between arms, as param -> arm -> its value(s) ("a | b" where the
    arm's own runs differ, NOT_LOGGED where its runs have no such param), and notes: an arm whose runs differ in more
    than the seed, params that only some runs of an arm logged (another Relax version). The seed, train.resume and
    tracking.* are left out: they differ from run to run by design."""
    logged = [r for r in runs if r.params]
    if not logged:
        return [], []
    keys = sorted(k for k in set().union(*(r.params for r in logged))
                  if k not in RUN_SPECIFIC_PARAMS and not k.startswith(RUN_SPECIFIC_PREFIXES))
    notes, partial = [], set()
    by_arm: dict[str, list[RunData]] = {}
    for r in logged:
        by_arm.setdefault(r.arm, []).append(r)
    shown: dict[str, dict[str, str]] = {}  # param -> arm -> its value(s)
    for arm, members in sorted(by_arm.items()):
        members = sorted(members, key=lambda r: _natural(_seed_key(r)))
        differing = []
        for k in keys:
            seen = list(dict.fromkeys(m.params[k] for m in members if k in m.params))
            absent = sum(k not in m.params for m in members)
            if 0 < absent < len(members):
                partial.add(k)
            shown.setdefault(k, {})[arm] = " | ".join(_short(v) for v in seen) or NOT_LOGGED
            if len(seen) > 1:
                differing.append(k)
        if differing:
            text = "; ".join(f"{k}: " + ", ".join(f"{_short(m.params[k])} ({_who(m)})" for m in members
                                                  if k in m.params) for k in differing[:6])
            more = f"; ... {len(differing) - 6} more" if len(differing) > 6 else ""
            notes.append(f"arm {arm}: its runs differ in config beyond the seed, so its spread over seeds is not seed "
                         f"noise alone: {text}{more}")
    if partial:
        names = sorted(partial)
        notes.append(f"{len(names)} param(s) logged by only some runs of an arm (runs of different Relax versions) "
                     f"are compared where logged: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}")
    diff = []
    if len(by_arm) > 1:
        diff = [(k, shown[k]) for k in keys if len(set(shown[k].values())) > 1]
    return diff, notes


def _control_hint(control: str, arms: Sequence[str]) -> str:
    """`grpo` for the arm `algorithm=grpo`: the arms one of whose values it is, else the close spellings."""
    by_value = [a for a in arms if _spelling(control) in (_spelling(p).partition("=")[2] for p in a.split(","))]
    if by_value:
        return f" (did you mean {' or '.join(by_value)}?)"
    return _did_you_mean(control, set(arms))


def summarize(runs: Sequence[RunData], metrics: Sequence[str], *, control: Optional[str] = None, last_k: int = 10,
              n_boot: int = 10_000, seed: int = 0, eval_last_k: int = 1,
              by: str | Sequence[str] = TAG_ARM) -> Comparison:
    """Per-arm statistics and paired differences to `control` for each metric; problems become notes, but runs of
    different configs in one arm (grouped by `by`) are a CompareError (`config_conflicts`).

    The numbers of a seed all come from one run (`choose_runs`). A run's final value of an eval/* metric is the mean
    of its last `eval_last_k` evaluations (default 1: the final model's), of any other metric the mean of its last
    `last_k` logged values."""
    arms = sorted({r.arm for r in runs})
    control = resolve_control(control, arms)
    if control is not None and control not in arms:
        raise CompareError(f"control arm {control!r} is not among the arms: {', '.join(arms) or '(no runs)'}"
                           f"{_control_hint(control, arms)}")
    config_conflicts(runs, by)
    chosen, dupe_notes = choose_runs(runs)
    comp = Comparison(list(metrics), arms, control, last_k, n_boot, runs=chosen, eval_last_k=eval_last_k)
    comp.notes += dupe_notes
    comp.config_diff, config_notes = config_differences(chosen)
    comp.notes += config_notes
    by_arm: dict[str, list[RunData]] = {a: [] for a in arms}
    for r in chosen:
        by_arm[r.arm].append(r)
    for arm, members in by_arm.items():
        seedless = sum(r.seed is None for r in members)
        if seedless:
            comp.notes.append(f"arm {arm}: {seedless} run(s) without a seed tag: "
                              "kept in the arm's statistics, left out of paired differences")
    for metric in metrics:
        k = comp.k_for(metric)
        finals_by_arm: dict[str, dict[str, float]] = {}
        last_steps: dict[int, list[str]] = {}
        for arm in arms:
            finals: dict[str, float] = {}
            tails: dict[str, list[int]] = {}
            missing = []
            for r in by_arm[arm]:
                history = [(s, v) for s, v in r.history.get(metric, []) if v is not None and math.isfinite(v)]
                value = final_value(history, k)
                if math.isnan(value):
                    missing.append(_seed_key(r))
                    continue
                finals[_seed_key(r)] = value
                tails[_seed_key(r)] = [s for s, _ in sorted(history)[-k:]]
                last_steps.setdefault(tails[_seed_key(r)][-1], []).append(_who(r))
            if missing:
                comp.arm_note("no_values", metric, arm, seeds=", ".join(sorted(missing, key=_natural)))
            finals_by_arm[arm] = finals
            mean, std = mean_std(list(finals.values()))
            if len(finals) == 1:
                comp.arm_note("single_seed", metric, arm)
            if finals:
                comp.stats.append(ArmStats(metric, arm, len(finals), mean, std, sorted(finals, key=_natural),
                                           finals, tails))
        if len(last_steps) > 1:
            where = "; ".join(f"{_step_name(metric, s)}: " + (", ".join(who[:4])
                                                                  + (f" and {len(who) - 4} more" if len(who) > 4
                                                                     else ""))
                              for s, who in sorted(last_steps.items()))
            comp.notes.append(f"{metric}: the runs' last values are at different steps ({where}): their final values "
                              "are not of the same point in training")
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
                comp.arm_note("no_shared_seed", metric, arm, control=control)
                continue
            diffs = [mine[s] - base[s] for s in common]
            lo, hi, how = paired_interval(diffs, n_boot=n_boot, seed=seed)
            if len(diffs) == 1:
                comp.arm_note("one_pair", metric, arm, control=control)
            comp.diffs.append(PairedDiff(metric, arm, control, len(diffs), sum(diffs) / len(diffs), lo, hi, common,
                                         how))
    compared = sorted({d.arm for d in comp.diffs if not math.isnan(d.ci_low)})
    if len(compared) > 1:
        k = len(compared)
        comp.notes.append(f"{k} arms are each compared with the control {control}: each 95% interval holds on its own, "
                          f"so that one of them leaves out 0 by chance alone is likelier than 5% (up to "
                          f"{1 - 0.95 ** k:.0%} for {k} independent comparisons, more with several metrics): confirm "
                          f"the best-looking arm with new seeds before claiming it (a Bonferroni correction would "
                          f"read each at {1 - 0.05 / k:.1%} instead of 95%)")
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
    arms, whatever the selector: a parent is the `mlflow.parentRunId` of a selected run, or carries the launcher's
    SWEEP_PARENT_TAG (a parent whose jobs' runs later sweeps reopened, so that none of them names it any more); runs
    that did not finish are left out (see `load_runs`).
    """
    if run_ids:
        return _runs_by_id(client, run_ids), f"run{'s' if len(run_ids) != 1 else ''} {', '.join(run_ids)}", None
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
            and SWEEP_PARENT_TAG not in r.data.tags
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


def _runs_by_id(client: MlflowClient, run_ids: Sequence[str]) -> list[Any]:
    """The runs `run_ids` names; every id the store does not hold is named in one CompareError."""
    from mlflow.exceptions import MlflowException

    runs, unknown = [], []
    for run_id in run_ids:
        try:
            runs.append(client.get_run(run_id))
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            unknown.append(run_id)
    if unknown:
        short = [r for r in unknown if len(r) != 32]
        hint = (f" (an MLflow run id has 32 hex characters; {', '.join(short)} "
                f"{'has' if len(short) == 1 else 'have'} {', '.join(str(len(r)) for r in short)})" if short else "")
        raise CompareError(f"no run {', '.join(unknown)} in {client.tracking_uri}{hint}")
    return runs


def _moved_runs(client: MlflowClient, exp_ids: Sequence[str], sweep: Optional[str]) -> list[Any]:
    """The runs of `sweep` that a later sweep's job reopened (a resumed sweep's, or an evaluation sweep's of a
    checkpoint: Tracker.reopen moves a run to the sweep of the job that reopens it, keeping the old id as
    PREVIOUS_SWEEP_TAG, the last earlier sweep only): they are that sweep's now, so `--sweep <sweep>` leaves them
    out."""
    if sweep is None:
        return []
    found = client.search_runs(list(exp_ids), filter_string=f"tags.`{PREVIOUS_SWEEP_TAG}` = {_quote(sweep)}",
                               max_results=1000)
    return [r for r in found if r.data.tags.get(TAG_SWEEP_ID) != sweep]


def _why_moved(moved: Sequence[Any]) -> str:
    """Why `moved` (`_moved_runs`) are another sweep's, and how to compare them: one wording for every message."""
    later = sorted({r.data.tags.get(TAG_SWEEP_ID) or "?" for r in moved})
    return (f"reopened by a job of sweep {', '.join(later)} (a resume, or an evaluation of a checkpoint), so they "
            f"belong to {'that sweep' if len(later) == 1 else 'those sweeps'} now; compare them with --sweep "
            f"{later[-1]}")


def _continued_by(client: MlflowClient, exp_ids: Sequence[str], sweep: Optional[str], some: bool = False) -> str:
    """The suffix of the error for a sweep none of whose runs are left to compare, when a later sweep took some
    (`_moved_runs`). `some`: the sweep still has runs (e.g. a crashed job's, which the later sweep restarted in a new
    run)."""
    moved = _moved_runs(client, exp_ids, sweep)
    return f": {'some of its' if some else 'its'} runs were {_why_moved(moved)}" if moved else ""


def _moved_away(client: MlflowClient, exp_ids: Sequence[str], sweep: Optional[str]) -> list[str]:
    """The note naming the runs of a compared sweep that a later sweep took (`_moved_runs`)."""
    moved = _moved_runs(client, exp_ids, sweep)
    if not moved:
        return []
    named = ", ".join(f"{r.info.run_id} (arm {r.data.tags.get(TAG_ARM)}, seed {r.data.tags.get(TAG_SEED)}, now in "
                      f"sweep {r.data.tags.get(TAG_SWEEP_ID)})" for r in moved)
    return [f"{len(moved)} run(s) of sweep {sweep} are left out: {named}; they were {_why_moved(moved)}"]


def by_keys(by: str | Sequence[str]) -> tuple[str, ...]:
    """The keys of a `--by`: one key, a comma list (`train.lr,model.lora_rank`) or a sequence of either (the option
    repeated). Tag and param names hold no comma, so a comma only ever separates keys."""
    parts = [by] if isinstance(by, str) else list(by)
    keys = tuple(k.strip() for p in parts for k in p.split(","))
    if not keys or any(not k for k in keys):
        raise CompareError(f"--by {','.join(parts)}: a key is empty (give tag or param names, e.g. --by "
                           "train.lr,model.lora_rank)")
    if len(set(keys)) < len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise CompareError(f"--by {','.join(keys)}: {', '.join(twice)} given more than once")
    return keys


def _key_value(run: Any, key: str) -> Optional[str]:
    tags, params = run.data.tags, run.data.params
    if key in tags:
        return tags[key]
    if key in params:
        return params[key]
    return None


def _group_value(run: Any, by: str | Sequence[str]) -> Optional[str]:
    """The run's arm: the value of its one `--by` key; with several keys `k1=v1,k2=v2` (the form of a sweep's arm
    tag, so --control takes it as typed), a key the run lacks as `(none)`. None where the run has none of them."""
    keys = by_keys(by)
    values = [_key_value(run, k) for k in keys]
    if all(v is None for v in values):
        return None
    if len(keys) == 1:
        return values[0]
    return ",".join(f"{k}={NO_VALUE if v is None else v}" for k, v in zip(keys, values, strict=True))


def _labelled(run: Any, by: str | Sequence[str]) -> str:
    """The run's arm as a note names it: `key=value` for one key; with several, the arm already names its keys."""
    keys = by_keys(by)
    value = _group_value(run, keys)
    return f"{keys[0]}={value}" if len(keys) == 1 else f"arm {value if value is not None else NO_VALUE}"


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


def load_runs(client: MlflowClient, runs: Sequence[Any], *, by: str | Sequence[str] = TAG_ARM,
              metrics: Optional[Sequence[str]] = None,
              include_unfinished: bool = False) -> tuple[list[RunData], list[str], list[str]]:
    """Histories of the chosen metrics (default: rollout/raw_reward and every eval/* present), runs and notes; a run's
    arm is the value of its `by` key, or of several keys `k1=v1,k2=v2` (`_group_value`)."""
    by = by_keys(by)
    notes: list[str] = []
    kept = []
    for r in runs:
        if r.info.status != "FINISHED" and not include_unfinished:
            notes.append(f"run {r.info.run_id} ({_labelled(r, by)}, seed {r.data.tags.get(TAG_SEED)}) is "
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
    for key in by:  # a key no run has would name no arm (one key) or put `(none)` in every arm (several)
        if kept and not any(_key_value(r, key) is not None for r in kept):
            raise CompareError(f"--by {','.join(by)}: none of the {len(kept)} selected runs has a tag or param "
                               f"{key!r} ({_keys_they_have(kept, key)})")
    out = []
    # an evaluation of saved weights (train.num_rollout=0) tagged with a training arm and seed is not another run of
    # that seed: next to training runs, such runs form an arm of their own
    eval_only = {r.info.run_id for r in kept if _evaluation_only(r.data.params)}
    split = bool(eval_only) and len(eval_only) < len(kept)
    if split:
        notes.append(f"{len(eval_only)} evaluation-only run(s) (train.num_rollout=0) are an arm of their own, "
                     f"'<arm>{EVAL_ONLY_SUFFIX}', not seeds of the training runs' arm: "
                     + ", ".join(f"{r.info.run_id} ({_labelled(r, by)}, seed {r.data.tags.get(TAG_SEED)})"
                                 for r in kept if r.info.run_id in eval_only))
    for r in kept:
        arm = _group_value(r, by)
        if arm is None:
            notes.append(f"run {r.info.run_id} has no tag or param {' or '.join(map(repr, by))}: grouped as "
                         f"{NO_VALUE}")
            arm = NO_VALUE
        elif len(by) > 1 and (lacks := [k for k in by if _key_value(r, k) is None]):
            # its arm names the keys it lacks as (none): runs of other combinations stay apart
            notes.append(f"run {r.info.run_id} has no tag or param {' or '.join(map(repr, lacks))}: its arm is {arm}")
        if split and r.info.run_id in eval_only:
            arm += EVAL_ONLY_SUFFIX
        history = {}
        for m in metrics:
            if m in r.data.metrics:
                history[m] = sorted((h.step, h.value) for h in client.get_metric_history(r.info.run_id, m))
        out.append(RunData(r.info.run_id, arm, r.data.tags.get(TAG_SEED), history, r.info.status,
                           r.data.tags.get(PARENT_RUN_ID_TAG), r.info.experiment_id, r.info.start_time or 0,
                           dict(r.data.params), r.data.tags.get(TAG_ARM)))
    notes += _eval_step_notes(kept, metrics, by)
    return out, list(metrics), notes


def _eval_step_notes(runs: Sequence[Any], metrics: Sequence[str], by: Sequence[str]) -> list[str]:
    """A note when the selected runs logged their evaluations at different steps: runs without the tag
    EVAL_STEP_TAG (made by a Relax before it) logged the evaluation after 0-based step s at step s, the others at
    s + 1, the number of training steps in the weights evaluated; steps are compared as logged, not moved."""
    if not any(m.startswith(EVAL_PREFIX) for m in metrics):
        return []
    evaluated = [r for r in runs if any(k.startswith(EVAL_PREFIX) for k in r.data.metrics)]
    older = [r for r in evaluated if r.data.tags.get(EVAL_STEP_TAG) != EVAL_STEP_WEIGHTS]
    if not older or len(older) == len(evaluated):
        return []
    named = "; ".join(f"{r.info.run_id} ({_labelled(r, by)}, seed {r.data.tags.get(TAG_SEED)}, "
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


def _steps_text(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}..{steps[-1]}"


def _steps_named(metric: str, steps: Sequence[int], listed: bool = False, word: bool = True) -> str:
    """Steps of `metric` (MLflow's numbers, sorted) as the output names them: an evaluation's as logged (the number
    of steps trained in the weights it evaluated); a training metric's as the progress line counts them (MLflow's
    step + 1, `step 3/3` once done), then as MLflow numbers them, to find them there (docs/operations.md, "Training
    steps are named ..."): "steps 1, 2, 3 (MLflow steps 0..2)". `listed`: every step, comma-separated; `word`: with
    the leading "step(s)"."""
    text = (lambda xs: ", ".join(map(str, xs))) if listed else _steps_text
    s = "s" if len(steps) > 1 else ""
    lead = f"step{s} " if word else ""
    if metric.startswith(EVAL_PREFIX):
        return lead + text(steps)
    consecutive = not listed and len(steps) > 1 and steps[-1] - steps[0] == len(steps) - 1
    mlflow = f"{steps[0]}..{steps[-1]}" if consecutive else text(steps)
    return f"{lead}{text([x + 1 for x in steps])} (MLflow step{s} {mlflow})"


def _step_name(metric: str, step: int) -> str:
    """One step of `metric` (MLflow's number) as `_steps_named` names it: "step 3 (MLflow step 2)", "step 4"."""
    return f"step {step}" if metric.startswith(EVAL_PREFIX) else steps_name([step])


def describe_final(metric: str, k: int, tails: Sequence[Sequence[int]]) -> str:
    """What a run's final value of `metric` is, with how many values went in and at which steps (`tails`: each
    run's steps that were averaged, MLflow's numbers; named as `_steps_named` names them)."""
    what = "evaluation" if metric.startswith(EVAL_PREFIX) else "value"
    option = "--eval-last-k" if what == "evaluation" else "--last-k"
    distinct = sorted({tuple(t) for t in tails})
    if not distinct:
        return f"final value = mean of each run's last {k} {what}s ({option} {k})"
    if len(distinct) == 1:
        steps = list(distinct[0])
        if len(steps) == 1:
            return f"final value = each run's last {what} ({_steps_named(metric, steps)}; {option} {k})"
        fewer = ", all there are" if len(steps) < k else ""
        return f"final value = mean of each run's last {len(steps)} {what}s ({_steps_named(metric, steps)}{fewer}; " \
               f"{option} {k})"
    counts = sorted({len(t) for t in distinct})
    lasts = _steps_named(metric, sorted({t[-1] for t in distinct}), listed=True, word=False)
    if counts == [1]:
        return f"final value = each run's last {what} ({option} {k}; the runs' last steps differ: {lasts})"
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    return f"final value = mean of each run's last {n} {what}s ({option} {k}; the runs' last steps differ: {lasts})"


def _arms_text(arms: Sequence[str], of: Sequence[str]) -> str:
    """Several arms in a merged note: every one of `of` (the arms it could be about) by their number, else named."""
    if list(arms) == list(of):
        return "both arms" if len(arms) == 2 else f"all {len(arms)} arms"
    return f"{len(arms)} arms ({', '.join(arms)})"


def _merged_notes(comp: Comparison) -> list[str]:
    """The notes, each written once: one that says the same of several metrics (`<metric>: <text>`) with all of them,
    one that says the same of several arms (a form of ARM_NOTES) with all of them (per metric; metrics of which it
    says it of the same arms together)."""
    merged: dict[Any, Any] = {}  # text -> metrics, or (form, fields) -> arm -> metrics; in the order of first notes
    for note in comp.notes:
        metric = next((m for m in comp.metrics if note.startswith(m + ": ")), None)
        if note in comp.note_forms:
            form, fields, arm = comp.note_forms[note]
            merged.setdefault((form, fields), {}).setdefault(arm, []).append(metric)
            continue
        text = note[len(metric) + 2:] if metric else note
        merged.setdefault(text, [])
        if metric:
            merged[text].append(metric)
    lines = []
    for key, value in merged.items():
        if isinstance(key, str):
            lines.append(f"{', '.join(value)}: {key}" if value else key)
            continue
        form, fields = key
        of = [a for a in comp.arms if a != dict(fields).get("control")]
        by_arms: dict[tuple[str, ...], list[str]] = {}  # the metrics of which it says it of the same arms
        for metric in comp.metrics:
            if arms := tuple(a for a in of if metric in value.get(a, ())):
                by_arms.setdefault(arms, []).append(metric)
        for arms, metrics in by_arms.items():
            one, several = ARM_NOTES[form]
            text = one.format(arm=arms[0], **dict(fields)) if len(arms) == 1 else \
                several.format(arms=_arms_text(arms, of), **dict(fields))
            lines.append(f"{', '.join(metrics)}: {text}")
    return lines


def _config_table(comp: Comparison) -> list[str]:
    """The params that differ between the arms: a column per arm while that fits CONFIG_TABLE_WIDTH, else (many
    arms, long names) a row per arm where that is narrower."""
    shown = comp.config_diff[:CONFIG_DIFF_SHOWN]
    by_param = _table(("param", *comp.arms), [(k, *(per_arm.get(a, "-") for a in comp.arms)) for k, per_arm in shown])
    if len(by_param[1]) + 2 <= CONFIG_TABLE_WIDTH:  # the rule line: as wide as the table
        return by_param
    by_arm = _table(("arm", *(k for k, _ in shown)), [(a, *(per_arm.get(a, "-") for _, per_arm in shown))
                                                     for a in comp.arms])
    return by_arm if len(by_arm[1]) < len(by_param[1]) else by_param


def render(comp: Comparison, *, title: str = "") -> str:
    """The terminal report: one table per metric (arms), the paired differences, then the notes."""
    lines = [title] if title else []
    if comp.config_diff:
        lines.append("")
        lines.append(f"config: the arms differ in {len(comp.config_diff)} param(s) (seed, train.resume and tracking.* "
                     "left out)")
        lines += ["  " + x for x in _config_table(comp)]
        if len(comp.config_diff) > CONFIG_DIFF_SHOWN:
            lines.append(f"  ... {len(comp.config_diff) - CONFIG_DIFF_SHOWN} more: "
                         + ", ".join(k for k, _ in comp.config_diff[CONFIG_DIFF_SHOWN:]))
    for metric in comp.metrics:
        stats = [s for s in comp.stats if s.metric == metric]
        lines.append("")
        tails = [t for s in stats for t in s.tails.values()]
        lines.append(f"{metric}: {describe_final(metric, comp.k_for(metric), tails)}; mean and std over seeds")
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
            lines += [f"  verdict for {d.arm}: {d.verdict}" for d in diffs]
    if comp.notes:
        lines.append("")
        lines += [f"note: {n}" for n in _merged_notes(comp)]
    return "\n".join(lines)


def _csv_num(x: float) -> str:
    return "" if math.isnan(x) else f"{x:.6g}"


def write_csv(comp: Comparison, path: Path) -> Path:
    """One row per (metric, arm): n, mean, std, seeds, per-seed finals, the number of last values each is the mean
    of (`last_k`) and their steps per seed (`final_steps`, MLflow's step numbers: a training metric's step 1 of the
    progress line is 0 there), and the paired difference to the control with its verdict."""
    path.parent.mkdir(parents=True, exist_ok=True)
    diffs = {(d.metric, d.arm): d for d in comp.diffs}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["metric", "arm", "is_control", "n_seeds", "mean", "std", "seeds", "finals", "last_k",
                    "control", "n_pairs", "diff_mean", "diff_ci_low", "diff_ci_high", "diff_ci_method", "verdict",
                    "final_steps"])
        for s in comp.stats:
            d = diffs.get((s.metric, s.arm))
            finals = ";".join(f"{k}={s.finals[k]:.6g}" for k in s.seeds)
            steps = ";".join(f"{k}={_steps_text(s.tails[k])}" for k in s.seeds if k in s.tails)
            w.writerow([s.metric, s.arm, s.arm == comp.control, s.n, f"{s.mean:.6g}",
                        "" if math.isnan(s.std) else f"{s.std:.6g}", ";".join(s.seeds), finals, comp.k_for(s.metric),
                        comp.control or "", d.n_pairs if d else "", f"{d.mean:.6g}" if d else "",
                        _csv_num(d.ci_low) if d else "", _csv_num(d.ci_high) if d else "",
                        d.ci_method if d else "", d.verdict if d else "", steps])
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
            by: str | Sequence[str] = TAG_ARM, metrics: Optional[Sequence[str]] = None, last_k: int = 10,
            control: Optional[str] = None, n_boot: int = 10_000, seed: int = 0, band: str = "minmax",
            out_dir: Optional[Path] = None, log: bool = True, include_unfinished: bool = False,
            eval_last_k: int = 1) -> CompareResult:
    """Select runs, compute the statistics, write the CSV and PNG, log them to MLflow; returns what it did. `by`: the
    tag or param whose value is a run's arm, or several (a comma list or a sequence): arms `k1=v1,k2=v2`."""
    import os
    import warnings

    by = by_keys(by)
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
    if not runs:  # why, run by run (their statuses, --include-unfinished), and where a continued sweep's runs went
        moved = _continued_by(client, _experiment_ids(client, experiment), sweep, some=True)
        raise CompareError(f"no finished runs in {description}{moved}" + "".join(f"\n  {n}" for n in notes))
    comp = summarize(runs, metric_list, control=control, last_k=last_k, n_boot=n_boot, seed=seed,
                     eval_last_k=eval_last_k, by=by)
    comp.notes[:0] = notes + _moved_away(client, _experiment_ids(client, experiment), sweep)
    if not comp.stats:  # nothing to write: the outputs of an earlier comparison stay as they are
        raise CompareError(f"no finite values of {', '.join(metric_list)} in the {len(runs)} selected runs of "
                           f"{description}")
    title = (f"relax-compare: {len(runs)} run{'s' if len(runs) != 1 else ''} of {description}, grouped by "
             f"{','.join(by)} ({uri})")
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
