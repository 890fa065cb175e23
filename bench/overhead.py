"""Overhead of the real loop: `relax.runner.train.run` on Ray, read from its `perf/*` metrics.

overhead = perf/step_time - perf/rollout_engine_time - perf/actor_compute_time: Ray calls, moving samples and
weights, rewards, advantages, anything else the driver does in a step (the metric names live in
relax/runner/train.py and relax/roles/workers.py). Also reports start-up: from calling `run` to the start of
its first step (Ray, role processes, model builds, the first weight sync), and where each goes:

- start-up, by phase: Ray (started or joined), the roles (from Ray up until every role process answers: a Ray
  worker, its imports of torch and transformers, its models), the rest (the MLflow session, the engines, the first
  weights);
- a step's overhead, by part (sync mode, from the rollout stream's timeline of calls): the engines' weight load before
  the step's generation, the generate call beyond the engine's own time, the reward calls, the train call beyond the
  actor's compute, and what remains (the driver's own work between them).

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


def measure(overrides: list[str], steps: int, log=print, ray_running: bool = False) -> dict:
    """`ray_running`: Ray is started before (and stopped after) the timed run, which joins it, as a run does in a
    process or on a cluster where Ray already runs (`cluster.address`, relax-submit); otherwise the run starts
    its own local Ray instance."""
    import ray

    from relax.runner.plan import LOCAL_RAY_SYSTEM_CONFIG

    start = ray_running and not ray.is_initialized()  # (the smoke suite keeps one Ray for all its runs)
    if start:
        ray.init(include_dashboard=False, logging_level="WARNING", num_cpus=2,
                 _system_config=LOCAL_RAY_SYSTEM_CONFIG)  # as a run starts it
    try:
        return _measure(overrides, steps, log, ray_running)
    finally:
        if start:
            ray.shutdown()


def _measure(overrides: list[str], steps: int, log, ray_running: bool) -> dict:
    from relax.config.compose import load_config
    from relax.roles.workers import ACTOR_COMPUTE_TIME
    from relax.runner import train
    from relax.runner.cluster import Cluster, RayRuntime
    from relax.runner.session import Session

    cfg = load_config([*overrides, f"train.num_rollout={steps}", "tracking.enabled=false", "tracking.progress=false",
                       "train.save=false"])
    logged: list[float] = []  # when each step's metrics were logged (right after its step time is taken)
    log_step = Session.log

    def timed_log(self, metrics, step, **kwargs):  # kwargs: Session.log's own (kept=)
        logged.append(time.perf_counter())
        return log_step(self, metrics, step, **kwargs)

    marks: dict[str, float] = {}  # when Ray was up and when every role answered (the first time each)
    streams: list = []  # the run's rollout stream, for its timeline of calls
    patched = {(RayRuntime, "__enter__"): "ray", (Cluster, "__enter__"): "roles", (train.Recipe, "setup"): "setup"}
    originals = {key: getattr(*key) for key in patched}

    def timed(key, name):
        def call(self, *args, **kwargs):
            out = originals[key](self, *args, **kwargs)
            marks.setdefault(name, time.perf_counter())
            if name == "setup":
                streams.append(self.stream)
            return out
        return call

    Session.log = timed_log
    for key, name in patched.items():
        setattr(*key, timed(key, name))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            result = train.run(cfg, output_dir=Path(tmp))
            wall = time.perf_counter() - t0
    finally:
        Session.log = log_step
        for key, fn in originals.items():
            setattr(*key, fn)
    hist = [m for _, m in result.history][1:] or [m for _, m in result.history]  # first step: warm-up
    step = Series([m[train.STEP_TIME] for m in hist])
    n = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt

    def med(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in hist)

    step0 = logged[0] - result.history[0][1][train.STEP_TIME]
    ray_up = marks.get("ray", t0)
    out = {
        "overrides": overrides, "steps": steps, "ray_running": ray_running, "samples_per_step": n, "wall_s": wall,
        # from calling run() to the start of step 0 (Ray, role processes, model builds, first weight sync)
        "startup_s": step0 - t0,
        "startup_parts": {"Ray": ray_up - t0, "roles": marks["roles"] - ray_up, "rest": step0 - marks["roles"]},
        "overhead_parts": overhead_parts(streams[0].timeline, result.history[1:], train, ACTOR_COMPUTE_TIME),
        "shutdown_s": t0 + wall - logged[-1],  # after the last step: summary, roles and Ray stopped
        "step": step, "samples_per_s": Series([n / s for s in step.values]),
        "fraction": Series([m[train.OVERHEAD_FRACTION] for m in hist]),
        "engine_s": med(train.ROLLOUT_ENGINE_TIME), "compute_s": med(ACTOR_COMPUTE_TIME),
        "overhead_s": med(train.OVERHEAD_TIME), "sync_s": med(train.SYNC_TIME),
        "rollout_call_s": med(train.ROLLOUT_TIME), "train_call_s": med(train.TRAIN_TIME),
    }
    log(f"  [ray loop {' '.join(overrides)}] step {step.median:.3f}s, overhead {out['fraction'].median:.1%} "
        f"({out['fraction'].spread}), start-up {out['startup_s']:.1f}s, shutdown {out['shutdown_s']:.1f}s")
    log(f"    start-up: {describe(out['startup_parts'], 1)}; overhead: {describe(out['overhead_parts'], 1000)}")
    return out


def describe(parts: dict[str, float], scale: float) -> str:
    """`parts` as "name value, ..." (seconds times `scale`: 1 for s, 1000 for ms)."""
    unit = "s" if scale == 1 else "ms"
    return ", ".join(f"{k} {v * scale:.1f} {unit}" for k, v in parts.items()) or "n/a"


def overhead_parts(timeline, history, train, compute_key: str) -> dict[str, float]:
    """The median step's overhead (seconds) by part, from the stream's timeline and each step's metrics: in sync mode
    every part below lies on the step's critical path. Steps without one span of each kind are left out."""
    spans: dict[tuple[str, int], float] = {}
    for sp in timeline:
        spans[(sp.kind, sp.step)] = spans.get((sp.kind, sp.step), 0.0) + sp.end - sp.start
    rows = []
    for step, m in history:
        if not all((kind, step) in spans for kind in ("load", "generate", "score")):
            continue
        parts = {"weights load": spans[("load", step)],  # version `step`: the weights step `step` generates with
                 "generate call": spans[("generate", step)] - m[train.ROLLOUT_ENGINE_TIME],
                 "reward calls": spans[("score", step)],
                 "train call": m[train.TRAIN_TIME] - m.get(compute_key, 0.0)}
        parts["rest"] = m[train.OVERHEAD_TIME] - sum(parts.values())
        rows.append(parts)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ray-running", action="store_true", help="start Ray before the run (it joins it)")
    ap.add_argument("overrides", nargs="*", help="extra relax-train overrides")
    a = ap.parse_args()
    r = measure([f"model={a.model}", *a.overrides], a.steps, ray_running=a.ray_running)
    print({k: (v.median if isinstance(v, Series) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
