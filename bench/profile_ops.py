"""Where a phase's time goes, by kind of operator: the profile behind the report's unmet targets.

Runs one phase under `torch.profiler` (CPU, self time of each operator, so a time is counted once) and sums the
operators into kinds: matmuls (mm/addmm/bmm/linear), attention (scaled-dot-product attention and its kernels), dtype
casts and copies, the optimizer (AdamW's foreach/fused kernels), normalisation, elementwise and the rest; the
share of the phase's wall time outside any operator (Python, the interpreter, waits) is reported as "outside
operators". The phases are the report's own work:

    python bench/profile_ops.py train --model smollm2_135m --dtype bfloat16      # bench/train_mfu.py's step
    python bench/profile_ops.py generate --model smollm2 --dtype bfloat16        # bench/rollout_vs_generate.py's engine
    python bench/profile_ops.py generate --model tiny --dtype float32 --batch 16 --n-samples 4 --prompt-len 32 \
        --new-tokens 64

Prints the kinds' shares, then the top operators (`--top`), and the JSON of the kinds as its last line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the first kind whose pattern is a substring of an operator's name takes it (order matters: "mm" is in "bmm" too)
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "sdpa")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
                "mkldnn", "onednn")),
    ("cast/copy", ("aten::_to_copy", "aten::copy_", "aten::to", "aten::clone", "aten::contiguous", "aten::cat",
                   "aten::index", "aten::gather", "aten::scatter", "aten::embedding")),
    ("optimizer", ("_foreach", "adam", "aten::_fused")),
    ("normalisation", ("rms_norm", "layer_norm", "aten::rsqrt", "aten::pow", "aten::mean")),
    ("softmax/log-softmax", ("softmax", "logsumexp")),
    ("elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::neg", "aten::silu", "aten::sigmoid",
                     "aten::exp", "aten::where", "aten::fill_", "aten::zero", "aten::sum", "aten::cos", "aten::sin",
                     "aten::max", "aten::min", "aten::clamp", "aten::log")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, patterns in KINDS:
        if any(p.lower() in low for p in patterns):
            return kind
    return "other"


def profile(fn, reps: int) -> tuple[dict[str, float], list[tuple[str, float, int]], float]:
    """(seconds per kind, top operators as (name, seconds, calls), wall seconds) of `reps` calls of `fn`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()  # warm-up: allocator, oneDNN primitives
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        wall = time.perf_counter() - t0
    kinds: dict[str, float] = {}
    ops = []
    for ev in prof.key_averages():
        if ev.self_cpu_time_total <= 0:
            continue
        s = ev.self_cpu_time_total / 1e6
        kinds[kind_of(ev.key)] = kinds.get(kind_of(ev.key), 0.0) + s
        ops.append((ev.key, s, ev.count))
    ops.sort(key=lambda o: -o[1])
    return kinds, ops, wall


def train_phase(a: argparse.Namespace):
    from bench.common import random_train_batch
    from relax.config.compose import load_config
    from relax.data.tokenizer import load_tokenizer
    from relax.roles.workers import ModelInfo, PolicyWorker

    cfg = load_config([f"model={a.model}", f"model.dtype={a.dtype}", f"train.micro_batch_size={a.micro}",
                       "tracking.enabled=false"])
    tok = load_tokenizer(cfg.model)
    worker = PolicyWorker(cfg, ModelInfo(len(tok), tok.pad_token_id, ()), threads=None)
    batch = random_train_batch(len(tok), a.rows, a.prompt_len, a.response_len)
    return lambda: worker.train_step(batch)


def generate_phase(a: argparse.Namespace):
    from bench.rollout_vs_generate import DTYPES, load_model
    from relax.models.hf import pick_device
    from relax.rollout.embedded import EmbeddedEngine

    model = load_model(a.model)
    engine = EmbeddedEngine(model, eos_token_ids=[], pad_token_id=0, dtype=DTYPES[a.dtype], device=pick_device())
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, model.config.vocab_size, (a.batch, a.prompt_len), generator=g).tolist()
    return lambda: engine.generate(prompts, n_samples_per_prompt=a.n_samples, max_new_tokens=a.new_tokens,
                                   temperature=1.0, top_p=1.0, top_k=-1, seed=0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["train", "generate"])
    ap.add_argument("--model", default=None, help="train: tiny or smollm2_135m; generate: tiny or smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    a.model = a.model or ("smollm2_135m" if a.phase == "train" else "smollm2")
    fn = train_phase(a) if a.phase == "train" else generate_phase(a)
    kinds, ops, wall = profile(fn, a.reps)
    inside = sum(kinds.values())
    print(f"{a.phase} {a.model} {a.dtype}: {wall / a.reps:.3f} s a call, {torch.get_num_threads()} threads; "
          f"operators' self time {inside / a.reps:.3f} s a call")
    shares = {k: v / inside for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    for k, v in shares.items():
        print(f"  {k:<20} {v:6.1%}  ({kinds[k] / a.reps:.3f} s a call)")
    # an operator's self time is the calling thread's wall time inside it (its intra-op threads are not added), so
    # the rest of the wall time is outside any operator: Python, the engine's bookkeeping, the profiler itself
    print(f"  outside operators    {1 - inside / wall:6.1%} of the wall time")
    print("top operators (self time a call, calls a call):")
    for name, s, n in ops[: a.top]:
        print(f"  {name:<48} {s / a.reps * 1e3:9.2f} ms  {n // a.reps:6d}  {kind_of(name)}")
    print(json.dumps({"phase": a.phase, "model": a.model, "dtype": a.dtype, "wall_s": wall / a.reps,
                      "shares": shares}))


if __name__ == "__main__":
    main()
