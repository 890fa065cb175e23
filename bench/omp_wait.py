"""OpenMP threads on shared cores: a role's train steps with GNU OpenMP's default wait policy (spin after each
parallel region), with a short spin (GOMP_SPINCOUNT=1000) and with OMP_WAIT_POLICY=PASSIVE (sleep at once), alone
and beside another process that computes on the same cores, as the roles of a run on a CPU machine do when they
compute at once (fully_async, the driver scoring beside a role, several runs or a test suite's workers).

Each measurement is a fresh process (the policy is read when torch loads OpenMP) training the tiny model with
torch's pool sized to every core, as a role sizes it; "beside a busy process" starts one more such process first,
computing for as long as the measured one runs. Both policies alternate in one run.

    python -m bench.omp_wait --reps 3 --steps 30

Not a `python -m bench` section (a CPU-only micro-benchmark of the process environment); its numbers are in
docs/performance.md, "OpenMP threads on shared cores".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import alternate, load_average

# GNU OpenMP's default; a short spin before sleeping; sleep at once
POLICIES: dict[str, dict[str, str]] = {"default (spin)": {}, "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
                                       "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}


def steps(n: int, threads: int) -> None:
    """`n` train steps of the tiny model (a forward and backward, an optimizer step, then five forwards as a
    rollout would), torch's pool at `threads`; prints the process's CPU seconds and wall seconds as JSON."""
    import torch

    torch.set_num_threads(threads)
    from relax.config import load_config
    from relax.models.hf import build_model

    model = build_model(load_config([]).model, 40, 0, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 40, (8, 24), generator=torch.Generator().manual_seed(0))
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        model(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for _ in range(5):
                model(input_ids=ids[:, :12])
    print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}))


def child(policy: dict[str, str], n: int, threads: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(policy)
    return subprocess.Popen([sys.executable, "-m", "bench.omp_wait", "--child", str(n), "--threads", str(threads)],
                            env=env, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])


def measure_once(policy: dict[str, str], n: int, threads: int, busy: bool) -> dict:
    """One measured process (its CPU and wall seconds), beside one busy process of the same policy when `busy`."""
    other = child(policy, 10 * n, threads) if busy else None
    try:
        out, _ = child(policy, n, threads).communicate(timeout=1800)
    finally:
        if other is not None:
            other.kill()
            other.wait()
    return json.loads(out)


def measure(reps: int, n: int, threads: int) -> dict:
    out: dict = {"load average before": load_average(), "cores": os.cpu_count(), "threads": threads, "steps": n}
    for busy in (False, True):
        seen: dict[str, list[dict]] = {name: [] for name in POLICIES}

        def side(name: str, seen: dict[str, list[dict]] = seen, busy: bool = busy):
            def run(_rep: int) -> float:
                seen[name].append(measure_once(POLICIES[name], n, threads, busy))
                return seen[name][-1]["cpu_s"]
            return run

        series = alternate({name: side(name) for name in POLICIES}, reps, warmup=False)
        where = "beside a busy process" if busy else "alone"
        out[where] = {name: {"cpu_s median": round(s.median, 2), "cpu_s spread": s.spread,
                             "wall_s median": round(sorted(r["wall_s"] for r in seen[name])[len(seen[name]) // 2], 2)}
                      for name, s in series.items()}
    out["load average after"] = load_average()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        steps(a.child, a.threads)
        return
    print(json.dumps(measure(a.reps, a.steps, a.threads), indent=2))


if __name__ == "__main__":
    main()
