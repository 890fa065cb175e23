"""Time the algorithm math: compute_loss forward + backward per algorithm and the M2PO solver.

Not a test. Example: `python bench/algorithm_math.py` (1M tokens, B=1024, T=1024) or
`python bench/algorithm_math.py --tokens 4096 --reps 2` (the CI smoke run).

Every `compute_loss fwd+bwd <algo>` row runs the same shared terms (TIS on, per-token reduction, no KL, no
entropy). The M2PO row gets its step statistics precomputed (`LossBatch.stats`), as a trainer hands them to every
micro-batch; `m2po solve + compute_loss fwd+bwd` adds the solve of those statistics from the batch (what
compute_loss does when `stats` is None), and `m2po_clip_bounds` times that solve alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

import relax.algorithms as A
from relax.algorithms import LossBatch, compute_loss
from relax.algorithms import functional as F


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_batch(B: int, T: int, device: torch.device, dtype: torch.dtype) -> LossBatch:
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    return LossBatch(
        logp=(old + 0.1 * torch.randn(B, T, generator=g, dtype=dtype)).to(device).requires_grad_(),
        old_logp=old.to(device),
        advantages=torch.randn(B, T, generator=g, dtype=dtype).to(device),
        mask=mask.to(device),
        ref_logp=(old + 0.05 * torch.randn(B, T, generator=g, dtype=dtype)).to(device),
        rollout_logp=(old + 0.05 * torch.randn(B, T, generator=g, dtype=dtype)).to(device),
    )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024 * 1024, help="tokens per batch (B*T)")
    parser.add_argument("--seq-len", type=int, default=1024, help="T")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    return parser


def run(args: argparse.Namespace, log=print) -> dict[str, float]:
    """{what: median seconds} of every row, printed as it goes."""
    results: dict[str, float] = {}

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    T = min(args.seq_len, args.tokens)
    B = max(1, args.tokens // T)
    batch = make_batch(B, T, device, dtype)
    n_tokens = float(batch.mask.sum())
    log(f"B={B} T={T} tokens={B * T} valid={int(n_tokens)} device={device} dtype={args.dtype} reps={args.reps}")
    log(f"{'what':<42}{'median ms':>12}{'Mtok/s':>10}")

    def row(what: str, seconds: float) -> None:
        results[what] = seconds
        log(f"{what:<42}{seconds * 1e3:>12.2f}{B * T / seconds / 1e6:>10.1f}")

    def step(cfg: A.AlgorithmConfig, b: LossBatch) -> None:
        b.logp.grad = None
        loss, _ = compute_loss(cfg, b, per_token=True, denominator=n_tokens)
        loss.backward()

    for name in A.names():
        algorithm = A.get(name)
        cfg = algorithm.config_cls(use_tis=True)
        b = batch
        if algorithm.needs_step_statistics:  # a trainer solves them once per step, before the micro-batches
            stats = algorithm.step_statistics(cfg, batch.logp.detach(), batch.old_logp, batch.advantages, batch.mask)
            b = dataclasses.replace(batch, stats=stats)
        row(f"compute_loss fwd+bwd {name}", timed(lambda cfg=cfg, b=b: step(cfg, b), args.reps, device))
        if algorithm.needs_step_statistics:
            with_solve = timed(lambda cfg=cfg: step(cfg, batch), args.reps, device)
            row(f"{name} solve + compute_loss fwd+bwd", with_solve)

    def solver() -> None:
        F.m2po_clip_bounds(batch.logp, batch.old_logp, batch.advantages, batch.mask, 1e-4, 0.0, 0.0)

    row("m2po_clip_bounds", timed(solver, args.reps, device))
    log_loss_spread(results, log)
    return results


def log_loss_spread(results: dict[str, float], log=print) -> None:
    """Each `compute_loss fwd+bwd <algo>` row (same work apart from the policy loss) relative to the cheapest."""
    prefix = "compute_loss fwd+bwd "
    rows = {k[len(prefix):]: v for k, v in results.items() if k.startswith(prefix)}
    cheapest = min(rows, key=rows.get)
    log(f"compute_loss relative to the cheapest ({cheapest}): "
        + ", ".join(f"{name} {seconds / rows[cheapest]:.2f}x" for name, seconds in rows.items()))


def main() -> None:
    run(parser().parse_args())


if __name__ == "__main__":
    main()
