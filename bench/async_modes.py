"""Training modes side by side: sync vs hybrid vs fully_async on the same work, through the real Ray loop.

Same model, prompts, samples and steps in every mode; the modes run one after the other, alternating, `--reps`
times each. samples/s = samples per step / step time (`perf/step_time`, the loop's wall time per step; the first
`--warmup` steps of each run are dropped: they include the rollout the pipeline starts with). The idle shares
are the runs' medians of `perf/train_idle_frac` (the loop waiting for its batch) and `perf/rollout_idle_frac`
(the engines not generating). Stale tokens need their old log-probs under the weights that generated them, an
extra forward pass on the actor that sync does not make; the last mode takes the engine's log-probs instead
(`algorithm.use_rollout_logprobs=true`), so its trainer does exactly sync's work. Sync's rollout and train
phases (`perf/rollout_time`, `perf/train_time`) say how balanced the work is: the asynchronous modes can at
best hide the shorter phase behind the longer one.

    python bench/async_modes.py --steps 12 --reps 2
    python bench/async_modes.py --steps 12 rollout.max_response_len=16     # other work: any relax-train override
    python bench/async_modes.py --steps 8 --reps 1 --judged                # rewards that take time (see `judged`)
    python bench/async_modes.py --modes sync,fully_async,fully_async_unstaged model=smollm2_135m ...  # staging
    python bench/async_modes.py --disjoint-cores --modes sync,hybrid,fully_async   # rollout, actor on own cores

`--disjoint-cores` gives the rollout the first half of this machine's usable cores and the actor the other half
(`cluster.role_cores`, docs/operations.md), as GPUs give each role a device of its own: in every mode, sync
included, each phase then computes on its own role's cores only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Series

MODES = {
    "sync": ["train.mode=sync"],
    "hybrid": ["train.mode=hybrid"],
    "fully_async": ["train.mode=fully_async", "train.max_staleness=2"],
    # the engine's log-probs as the behaviour policy's: no recomputation of stale tokens' old log-probs on the actor
    "fully_async_rollout_logp": ["train.mode=fully_async", "train.max_staleness=2",
                                 "algorithm.use_rollout_logprobs=true"],
    # the asynchronous modes without rollout.stage_weights (each load copies the weights on the rollout's critical
    # path): `--modes sync,hybrid,hybrid_unstaged,fully_async,fully_async_unstaged` compares the two side by side
    "hybrid_unstaged": ["train.mode=hybrid", "rollout.stage_weights=false"],
    "fully_async_unstaged": ["train.mode=fully_async", "train.max_staleness=2", "rollout.stage_weights=false"],
}
DEFAULT_MODES = ("sync", "hybrid", "fully_async", "fully_async_rollout_logp")
# A reward that takes time, as a judge model or a code sandbox does: the digits reward after JUDGE_S seconds a call
# (a sleep: it costs no CPU, so on two cores the engines can use the time). `--judged` scores with it.
JUDGE_S = 0.02
JUDGED = ["data.reward=bench.async_modes:judged"]


def judged(response: str, label: str) -> float:
    import time

    from relax.rewards.digits import digits_reward

    time.sleep(JUDGE_S)
    return digits_reward(response, label)


# The default work: the tiny model on the digits task, with long enough responses that generating a batch takes
# about as long as training on it (sync's rollout and train phases are printed to check).
WORK = ["model=tiny", "algorithm=grpo", "rollout.max_response_len=32", "train.micro_batch_size=64"]
# The same with the rollout and the actor on a core each (--disjoint-cores): the engine on one core is relatively
# slower than the trainer, so shorter responses balance the phases (sync's train and rollout idle ~50% each).
DISJOINT_WORK = ["model=tiny", "algorithm=grpo", "rollout.max_response_len=20", "train.micro_batch_size=64"]


def disjoint_cores() -> str | None:
    """The override that puts the rollout on the first half of this machine's usable cores and the actor on the
    rest (cluster.role_cores); None with fewer than two cores."""
    from relax.config.core_rules import format_cores

    cores = tuple(sorted(os.sched_getaffinity(0)))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return f"+cluster.role_cores={{rollout:'{format_cores(cores[:half])}',actor:'{format_cores(cores[half:])}'}}"


def run_once(overrides: list[str], steps: int, warmup: int) -> dict:
    from relax.config.compose import load_config
    from relax.metrics import ROLLOUT_IDLE_FRAC, ROLLOUT_TIME, STEP_TIME, TRAIN_IDLE_FRAC, TRAIN_TIME
    from relax.runner import train
    cfg = load_config([*overrides, f"train.num_rollout={steps}", "tracking.enabled=false", "tracking.progress=false",
                       "train.save=false"])
    with tempfile.TemporaryDirectory() as tmp:
        result = train.run(cfg, output_dir=Path(tmp))
    hist = [m for _, m in result.history][warmup:]
    n = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt

    def med(key: str) -> float:
        return statistics.median(m[key] for m in hist)

    return {"samples_per_s": n * len(hist) / sum(m[STEP_TIME] for m in hist), "train_idle": med(TRAIN_IDLE_FRAC),
            "rollout_idle": med(ROLLOUT_IDLE_FRAC), "rollout_s": med(ROLLOUT_TIME), "train_s": med(TRAIN_TIME)}


def compare(work: list[str], steps: int, reps: int, warmup: int = 2, log=print,
            modes: tuple[str, ...] = DEFAULT_MODES) -> dict:
    """{mode: {"samples_per_s": Series, "train_idle": Series, ...}, "speedup": {mode: Series vs sync}} for `modes`
    (sync among them)."""
    out: dict = {m: {} for m in modes}
    for rep in range(reps):
        order = list(modes) if rep % 2 == 0 else list(reversed(modes))
        for mode in order:
            r = run_once([*work, *MODES[mode]], steps, warmup)
            for key, value in r.items():
                out[mode].setdefault(key, Series([])).values.append(value)
            log(f"  [modes {mode} rep {rep}] {r['samples_per_s']:.1f} samples/s, train idle {r['train_idle']:.0%}, "
                f"rollout idle {r['rollout_idle']:.0%}")
    sync = out["sync"]["samples_per_s"].values
    out["speedup"] = {m: Series([a / b for a, b in zip(out[m]["samples_per_s"].values, sync, strict=True)])
                      for m in modes}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--judged", action="store_true", help=f"score with `judged` ({JUDGE_S} s a reward call)")
    ap.add_argument("overrides", nargs="*", help=f"relax-train overrides for the work (default: {' '.join(WORK)})")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, sync first; of {list(MODES)}")
    ap.add_argument("--disjoint-cores", action="store_true",
                    help="the rollout on the first half of the usable cores, the actor on the rest (role_cores)")
    a = ap.parse_args()
    modes = tuple(a.modes.split(","))
    unknown = [m for m in modes if m not in MODES]
    if unknown or "sync" not in modes:
        ap.error(f"--modes: {unknown or 'sync missing'} (known: {', '.join(MODES)}; sync is the baseline)")
    cores, work = [], a.overrides or WORK
    if a.disjoint_cores:
        if (override := disjoint_cores()) is None:
            ap.error("--disjoint-cores needs two usable cores at least")
        cores, work = [override], a.overrides or DISJOINT_WORK
    r = compare([*work, *(JUDGED if a.judged else []), *cores], a.steps, a.reps, a.warmup, modes=modes)
    for mode in modes:
        print(f"{mode:<12} {r[mode]['samples_per_s'].median:7.1f} samples/s  x{r['speedup'][mode].median:.2f} vs sync  "
              f"train idle {r[mode]['train_idle'].median:.0%}  rollout idle {r[mode]['rollout_idle'].median:.0%}")


if __name__ == "__main__":
    main()
