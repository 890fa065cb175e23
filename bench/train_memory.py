"""Memory and time of one actor `train_step`: peak resident memory of the process, and its step-time.

    python bench/train_memory.py --model smollm2_135m --dtype float32 --rows 16 --prompt-len 32 \
        --response-len 96 --micro 8

Run it as its own (fresh) process: it reads the process's own peak resident set (VmHWM of /proc/self/status).
The trainer is the real one (`PolicyWorker` -> `relax.train.torch_policy.TorchPolicy`, as in
bench/train_mfu.py), the batch is random (all tokens valid). Sequence:

1. build the worker (model + AdamW, no optimizer state yet): `rss_built_mib`;
2. one warm-up `train_step` (allocates AdamW's moments): `rss_base_mib` is the resident set after it, once
   malloc has returned free memory (malloc_trim), i.e. weights + AdamW state + what the allocator keeps;
3. `--reps` measured steps; before each the peak counter is reset (`/proc/self/clear_refs` = 5), after each
   `activation_mib` = VmHWM - resident set before the step (the gradients, ~4 bytes per parameter, and
   everything the forward/backward holds) and `time_s` = the step's wall time.

glibc malloc keeps some freed memory (the resident set after a micro-batch's backward stays well above what is
live), so the default numbers are what the process costs, not what is live at the peak; with
`MALLOC_MMAP_THRESHOLD_=65536` in the environment every tensor of 64 KiB or more is mapped and unmapped on its own
and `activation_mib` tracks live memory closely (at some cost in time; the JSON records the setting).

`peak_total_mib` is the process's peak over its whole life (VmHWM before the first reset, which covers model
loading and the warm-up step, and after each measured step). One JSON line on stdout (`time_s` and
`activation_mib`: min, median and every value); progress on stderr. The machine may be shared: read min and
median, not a single value.

On a GPU (where the trainer runs when there is one) the same fields are the CUDA caching allocator's: memory
allocated instead of the resident set, `torch.cuda.max_memory_allocated` (reset before each step) instead of
VmHWM; `"memory"` in the JSON says which.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average, random_train_batch, synchronize

MIB = 2**20


def status_kib(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def release_free_memory() -> None:
    """Give free heap memory back to the OS (glibc malloc_trim), so the resident set is what is in use."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Meter:
    """KiB in use now, and the peak since the last reset: the process's resident set on the CPU, the CUDA
    allocator's memory on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.what = "cuda allocated" if self.cuda else "process resident"

    def now(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated() // 1024
        release_free_memory()
        return status_kib("VmRSS")

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() // 1024 if self.cuda else status_kib("VmHWM")

    def reset(self) -> bool:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return True
        return reset_peak()


def summary(values: list[float], digits: int) -> dict:
    return {"min": round(min(values), digits), "median": round(statistics.median(values), digits),
            "values": [round(v, digits) for v in values]}


def measure(model_name: str, dtype: str, *, rows: int, prompt_len: int, response_len: int, micro: int, reps: int,
            entropy_coef: float = 0.0, threads: int | None = None, gradient_checkpointing: bool = False,
            lora_rank: int = 0, log=None) -> dict:
    from relax.config.compose import load_config
    from relax.data.tokenizer import load_tokenizer
    from relax.roles.workers import ModelInfo, PolicyWorker

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    load = load_average()
    cfg = load_config([f"model={model_name}", f"model.dtype={dtype}", f"train.micro_batch_size={micro}",
                       f"algorithm.entropy_coef={entropy_coef}", "tracking.enabled=false",
                       f"model.gradient_checkpointing={str(gradient_checkpointing).lower()}",
                       f"model.lora_rank={lora_rank}"])
    tok = load_tokenizer(cfg.model)
    worker = PolicyWorker(cfg, ModelInfo(len(tok), tok.pad_token_id, ()), threads=threads)
    meter = Meter(worker.policy.device)
    rss_built = meter.now()
    V = len(tok)
    batch = random_train_batch(V, rows, prompt_len, response_len)
    t0 = time.perf_counter()
    worker.train_step(batch)  # warm-up: AdamW's state is allocated here
    log(f"  [{model_name} {dtype} micro={micro}] warm-up step {time.perf_counter() - t0:.2f} s")
    rss_base = meter.now()
    peak_before = meter.peak() / 1024  # loading and the warm-up step (resetting the peak forgets it)
    times, activations, peaks = [], [], []
    resettable = True
    for rep in range(reps):
        before = meter.now()
        resettable = meter.reset() and resettable
        t0 = time.perf_counter()
        worker.train_step(batch)
        synchronize(worker.policy.device)
        times.append(time.perf_counter() - t0)
        peak = meter.peak()
        peaks.append(peak / 1024)
        activations.append((peak - before) / 1024)
        log(f"  [{model_name} {dtype} micro={micro}] rep {rep}: {times[-1]:.2f} s, activation "
            f"{activations[-1]:.0f} MiB, peak {peaks[-1]:.0f} MiB")
    return {
        "bench": "train_memory", "model": model_name, "dtype": dtype, "memory": meter.what,
        "compute_dtype": str(worker.policy.compute_dtype).replace("torch.", ""),
        "rows": rows, "prompt_len": prompt_len, "response_len": response_len, "micro": micro,
        "entropy_coef": entropy_coef, "gradient_checkpointing": gradient_checkpointing, "lora_rank": lora_rank,
        "vocab": V,
        "threads": torch.get_num_threads(), "reps": reps,
        "time_s": summary(times, 3),
        "activation_mib": summary(activations, 1),
        "peak_step_mib": round(max(peaks), 1),
        "rss_built_mib": round(rss_built / 1024, 1),
        "rss_base_mib": round(rss_base / 1024, 1),
        "peak_total_mib": round(max([peak_before, *peaks]), 1),
        "peak_reset": resettable,  # False: VmHWM could not be reset, activation_mib is an upper bound
        "load_average": load,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "pid": os.getpid(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m", choices=["tiny", "smollm2_135m"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--entropy-coef", type=float, default=0.0,
                    help="> 0: the entropy term has a gradient (entropy mode 'grad'); 0: only measured")
    ap.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False,
                    help="model.gradient_checkpointing: recompute each layer's activations in the backward")
    ap.add_argument("--lora-rank", type=int, default=0, help="model.lora_rank: > 0 trains LoRA adapters only")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: every usable core; 1 is steadier on a shared machine)")
    a = ap.parse_args(argv)
    r = measure(a.model, a.dtype, rows=a.rows, prompt_len=a.prompt_len, response_len=a.response_len, micro=a.micro,
                reps=a.reps, entropy_coef=a.entropy_coef, threads=a.threads,
                gradient_checkpointing=a.gradient_checkpointing, lora_rank=a.lora_rank)
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
