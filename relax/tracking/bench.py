"""Measure what tracking costs a training step: `python -m relax.tracking.bench [--steps N] [--metrics M]`.

The budget is well under 1% of a 1-5 s training step, i.e. < 10 ms per step at most. The cost is
`log_metrics` (in memory) on every step plus a `log_batch` write every `flush_every_steps` steps;
the per-step figure reported is their sum divided by the number of steps.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Optional

from relax.tracking.mlflow_run import Tracker
from relax.tracking.run_options import RunOptions


def measure_tracking_cost(
    uri: str,
    *,
    experiment: str = "relax-bench",
    steps: int = 200,
    metrics_per_step: int = 30,
    flush_every_steps: int = 10,
    background: bool = True,
) -> dict[str, float]:
    """Log `steps` x `metrics_per_step` metrics into a fresh run at `uri`; return timings.

    `caller_us_per_step`: time `log_metrics` takes on the training thread (with `background=False` it
    includes the writes). `write_ms_per_step`: time spent in `log_batch` writes, whichever thread did
    them, divided by steps. Run start (MLflow import, schema check) is a one-off, reported apart.
    """
    from relax.config.schema import TrackingConfig

    t0 = time.perf_counter()
    tracker = Tracker.start(
        TrackingConfig(uri=uri, experiment=experiment),
        RunOptions(flush_every_steps=flush_every_steps, flush_interval_s=1e9, background=background, announce=False),
        run_name="bench",
        tags={},
        params={},
    )
    start_ms = (time.perf_counter() - t0) * 1000
    keys = [f"bench/metric_{i:02d}" for i in range(metrics_per_step)]
    caller_s = 0.0
    for step in range(1, steps + 1):
        metrics = {k: step * 0.001 + i for i, k in enumerate(keys)}
        t = time.perf_counter()
        tracker.log_metrics(metrics, step)
        caller_s += time.perf_counter() - t
        time.sleep(0.001)  # a (very) short training step, so the writer thread gets to run
    t = time.perf_counter()
    tracker.finish()
    finish_ms = (time.perf_counter() - t) * 1000
    stats = tracker.stats
    return {
        "start_ms": start_ms,
        "caller_us_per_step": 1e6 * caller_s / steps,
        "write_ms_per_step": 1000 * stats["write_s"] / steps,
        "write_ms_per_batch": 1000 * stats["write_s"] / max(1, stats["batches"]),
        "batches": float(stats["batches"]),
        "metrics": float(stats["metrics"]),
        "finish_ms": finish_ms,
    }


def main(argv: Optional[list[str]] = None) -> None:
    """Print the per-step tracking cost against a throwaway sqlite store (or `--uri`)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--metrics", type=int, default=30)
    parser.add_argument("--flush-every", type=int, default=10)
    parser.add_argument("--uri", default=None, help="default: sqlite in a temporary directory")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        uri = args.uri or f"sqlite:///{os.path.join(tmp, 'mlflow.db')}"
        for background in (True, False):
            r = measure_tracking_cost(
                uri,
                steps=args.steps,
                metrics_per_step=args.metrics,
                flush_every_steps=args.flush_every,
                background=background,
            )
            mode = "background writer" if background else "synchronous writes"
            print(f"{args.steps} steps x {args.metrics} metrics, flush every {args.flush_every} steps, {mode} ({uri})")
            print(f"  training thread: {r['caller_us_per_step']:.1f} us/step")
            print(
                f"  log_batch writes: {r['write_ms_per_step']:.3f} ms/step ({r['write_ms_per_batch']:.1f} ms per batch"
                f" of {r['metrics'] / max(1, r['batches']):.0f}) = {r['write_ms_per_step'] / 10:.3f}% of a 1 s step"
            )
            print(f"  one-off: start {r['start_ms']:.0f} ms, finish {r['finish_ms']:.1f} ms")


if __name__ == "__main__":
    main()
