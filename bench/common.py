"""What every benchmark of the suite shares: machine description, alternating timing, statistics."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine_info() -> dict[str, str]:
    import torch
    import transformers

    from relax.models.hf import cpu_has_fast_bf16
    from relax.train.trainer import available_cpus

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    mem = "n/a"
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    if torch.cuda.is_available() and (peak := datasheet_bf16_flops(gpu)) is not None:
        gpu += f" (datasheet dense bf16 peak {peak / 1e12:.0f} TFLOP/s)"
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu_model(),
        "cores (usable)": str(available_cpus()),
        "memory": mem,
        "bf16 matmul (AVX512-BF16/AMX)": str(cpu_has_fast_bf16()),
        "gpu": gpu,
        "torch threads": str(torch.get_num_threads()),
        "python / torch / transformers / trl": f"{platform.python_version()} / {torch.__version__} / "
        f"{transformers.__version__} / {trl_version}",
        "load average (1/5/15 min) at start": load_average(),
    }


@dataclass
class Series:
    """Repeated measurements of one side (values: a rate or a duration, as named by `unit`)."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def spread(self) -> str:
        if not self.values:
            return "n/a"
        return f"{min(self.values):.3g}-{max(self.values):.3g} (n={len(self.values)})"


def alternate(sides: dict[str, Callable[[int], float]], reps: int, warmup: bool = True) -> dict[str, Series]:
    """Run each side `reps` times, alternating the order every repetition (ABBA...), after one warm-up each.

    Each callable takes the repetition index and returns its measurement (for example samples/s).
    """
    names = list(sides)
    if warmup:
        for name in names:
            sides[name](-1)
    out = {name: Series() for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            out[name].values.append(sides[name](rep))
    return out


def ratio_series(a: Series, b: Series) -> Series:
    """Per-repetition ratios a/b (repetitions of both sides ran next to each other)."""
    return Series([x / y for x, y in zip(a.values, b.values, strict=False) if y > 0])


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so that a timer stopped after it is honest."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s), by a substring of the device's name: MFU is
# reported against them where the name matches, next to the fraction of the matmul peak measured on the device.
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.4,
                         "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0}


def datasheet_bf16_flops(device_name: str) -> float | None:
    """The datasheet dense bf16 FLOP/s of a GPU by its name, or None when it is not in the table."""
    for key, tflops in DATASHEET_BF16_TFLOPS.items():  # the more specific names come first
        if key in device_name:
            return tflops * 1e12
    return None


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0


def random_train_batch(vocab: int, rows: int, prompt_len: int, response_len: int, seed: int = 0):
    """A TrainBatch of random tokens, every position valid (no padding), random rollout log-probs, rewards and
    per-sequence advantages: a fixed amount of work for the trainer benchmarks."""
    import torch

    from relax.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    return TrainBatch(
        prompt_ids=torch.randint(4, vocab, (rows, prompt_len), generator=g),
        prompt_mask=torch.ones(rows, prompt_len, dtype=torch.long),
        response_ids=torch.randint(4, vocab, (rows, response_len), generator=g),
        response_mask=torch.ones(rows, response_len, dtype=torch.long),
        rollout_logp=-torch.rand(rows, response_len, generator=g),
        finish_reason=["length"] * rows,
        rewards=torch.randn(rows, generator=g),
        advantages=torch.randn(rows, 1, generator=g).expand(rows, response_len).contiguous(),
    )


def run_script(script: str, argv: list[str], *, fresh: bool = True, env: dict[str, str] | None = None) -> dict:
    """The JSON line that bench/`script`.py prints (its last line of stdout) for `argv`.

    fresh: the script in a process of its own (python bench/<script>.py ARGV, with `env`), so that its peak resident
    set is its run's alone. Otherwise (smoke runs, whose numbers are not read) its `main(argv)` in this process,
    stdout captured: the same arguments, measurement and JSON, without the start-up of another interpreter; `env`
    is not applied there (MALLOC_MMAP_THRESHOLD_ is read when a process starts)."""
    import contextlib
    import importlib
    import io
    import json
    import subprocess
    import sys
    from pathlib import Path

    if fresh:
        path = Path(__file__).with_name(f"{script}.py")
        out = subprocess.run([sys.executable, str(path), *argv], capture_output=True, text=True, check=True,
                             env=env).stdout
    else:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            importlib.import_module(f"bench.{script}").main(argv)
        out = buf.getvalue()
    return json.loads(out.strip().splitlines()[-1])
