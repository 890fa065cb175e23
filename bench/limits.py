"""What an RL step would take at the machine's limits: its FLOPs at the measured matmul peak, its decode at the
measured memory bandwidth.

- training: 6·N FLOPs per token of every trained row (prompt and response: the forward and backward run over both);
- generation: 2·N per prefilled token; each decode step costs the larger of 2·N·rows FLOPs and one read of the
  weights from memory (small-batch decode is bandwidth-bound).

N = the parameters used in matmuls per token (`bench.train_mfu.matmul_params`). A step at 1.0x its limit would
run every matmul at the peak of a large square `torch.mm` and stream the weights at the speed of a large copy;
attention, elementwise work, the optimizer and the loop's own cost all count against the measured step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bench.train_mfu import matmul_flops

MM_SIZE = 2048  # of the square matmuls whose peak is the machine's


def memory_bandwidth(megabytes: int = 256, reps: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write), the best of `reps`."""
    n = megabytes * 1024 * 1024 // 4
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


@dataclass
class Machine:
    peak_flops: float  # of the compute dtype's matmul
    bandwidth: float  # bytes/s

    @classmethod
    def measure(cls, compute_dtype: torch.dtype, mm_size: int = MM_SIZE) -> Machine:
        """The peak of `mm_size`-square matmuls and a copy of 16 such fp32 matrices' bytes (256 MiB at the
        default). Smaller sizes fit in the caches and measure them, not the machine: for smoke runs only."""
        copy_mib = max(1, 16 * mm_size * mm_size * 4 // 2**20)
        return cls(peak_flops=max(matmul_flops(compute_dtype, mm_size, 3).values),
                   bandwidth=memory_bandwidth(copy_mib))


def step_limit_s(machine: Machine, *, matmul_params: int, weight_bytes: int, rows: int, prompt_tokens: int,
                 response_len: int) -> dict[str, float]:
    """Seconds a step of `rows` samples (`prompt_tokens` prompt tokens in all, `response_len` tokens each) takes at
    the machine's limits: {"train", "prefill", "decode", "total"}."""
    n = matmul_params
    trained = prompt_tokens + rows * response_len
    train = 6 * n * trained / machine.peak_flops
    prefill = 2 * n * prompt_tokens / machine.peak_flops
    decode = response_len * max(2 * n * rows / machine.peak_flops, weight_bytes / machine.bandwidth)
    return {"train": train, "prefill": prefill, "decode": decode, "total": train + prefill + decode}
