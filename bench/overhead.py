"""Overhead of the real loop: `relax.runner.train.run` on Ray, read from its `perf/*` metrics.

overhead = perf/step_time - perf/rollout_engine_time - perf/actor_compute_time: Ray calls, moving samples and
weights, rewards, advantages, anything else the driver does in a step (the metric names live in
relax/runner/train.py and relax/roles/workers.py). Also reports start-up (Ray, actors, model builds: the wall
time of `run` not spent in steps).

    python bench/overhead.py --model tiny --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Series


def measure(overrides: list[str], steps: int, log=print) -> dict:
    from relax.config.compose import load_config
    from relax.roles.workers import ACTOR_COMPUTE_TIME
    from relax.runner import train

    cfg = load_config([*overrides, f"train.num_rollout={steps}", "tracking.enabled=false", "tracking.progress=false",
                       "train.save=false"])
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = train.run(cfg, output_dir=Path(tmp))
        wall = time.perf_counter() - t0
    hist = [m for _, m in result.history][1:] or [m for _, m in result.history]  # first step: warm-up
    step = Series([m[train.STEP_TIME] for m in hist])
    n = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt

    def med(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in hist)

    out = {
        "overrides": overrides, "steps": steps, "samples_per_step": n, "wall_s": wall,
        "startup_s": wall - sum(m[train.STEP_TIME] for _, m in result.history),
        "step": step, "samples_per_s": Series([n / s for s in step.values]),
        "fraction": Series([m[train.OVERHEAD_FRACTION] for m in hist]),
        "engine_s": med(train.ROLLOUT_ENGINE_TIME), "compute_s": med(ACTOR_COMPUTE_TIME),
        "overhead_s": med(train.OVERHEAD_TIME), "sync_s": med(train.SYNC_TIME),
        "rollout_call_s": med(train.ROLLOUT_TIME), "train_call_s": med(train.TRAIN_TIME),
    }
    log(f"  [ray loop {' '.join(overrides)}] step {step.median:.3f}s, overhead {out['fraction'].median:.1%} "
        f"({out['fraction'].spread}), start-up {out['startup_s']:.1f}s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("overrides", nargs="*", help="extra relax-train overrides")
    a = ap.parse_args()
    r = measure([f"model={a.model}", *a.overrides], a.steps)
    print({k: (v.median if isinstance(v, Series) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
