"""Cost as work grows: the time and peak memory of one actor `train_step` as the response length doubles at a fixed
number of tokens per step, and as the group size doubles, padded and packed (`train.pack_sequences`), against the
step's limit on the machine.

    python bench/cost_growth.py --model smollm2_135m --tokens 2048 --lengths 32 64 128 256 512 \
        --groups 2 4 8 16 --group-len 64

Responses vary in length as RL responses do: in a batch of response length L the rows' responses spread evenly
over L/4..L (a 4x spread), in a fixed shuffled order, right-padded to L. The length curve keeps the real tokens of
a step near `--tokens` (rows = tokens / (prompt + mean response)); the group curve takes `--prompts` prompts with
G samples each at `--group-len`, so its tokens double with G. Micro-batches are formed by tokens
(`train.max_tokens_per_micro_batch=--budget`, padding included when padded), so that memory follows the budget,
not the batch. Each setting (padded, packed) builds the real trainer once (`PolicyWorker` -> `TorchPolicy`, as in
bench/train_memory.py), takes one warm-up step (AdamW's state), then `--reps` steps per point: time (min and
median) and the step's activation memory (the peak resident set during the step over the one before it, the peak
reset before each step; run with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors leave the resident set, as
run_all does). The limit of a step is its real tokens' training FLOPs (6 x matmul parameters x tokens) at the
machine's measured matmul throughput (bench/limits.py). Run it as its own process; one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average, random_train_batch, synchronize
from bench.limits import MM_SIZE

SPREAD = 4  # the longest response of a batch is this many times the shortest


def spread_batch(vocab: int, rows: int, prompt_len: int, response_len: int, seed: int = 0):
    """`random_train_batch` with response lengths spread evenly over response_len / SPREAD .. response_len (a fixed
    shuffled order), right-padded: (batch, real tokens)."""
    batch = random_train_batch(vocab, rows, prompt_len, response_len, seed)
    shortest = max(1, response_len // SPREAD)
    lengths = torch.linspace(shortest, response_len, rows).round().long()
    lengths = lengths[torch.randperm(rows, generator=torch.Generator().manual_seed(seed))]
    mask = (torch.arange(response_len)[None] < lengths[:, None]).long()
    batch.response_mask = mask
    batch.response_ids = batch.response_ids * mask
    batch.finish_reason = ["stop" if int(n) < response_len else "length" for n in lengths]
    return batch, int(rows * prompt_len + lengths.sum())


def points(tokens: int, prompt_len: int, lengths: list[int], prompts: int, groups: list[int],
           group_len: int) -> dict[str, list[dict]]:
    """The two curves' batches: {"length": [{L, rows}], "group": [{G, L, rows}]}."""
    mean = lambda n: (max(1, n // SPREAD) + n) / 2  # noqa: E731 - a response's mean length at L = n
    return {"length": [{"L": n, "rows": max(1, round(tokens / (prompt_len + mean(n))))} for n in lengths],
            "group": [{"G": g, "L": group_len, "rows": prompts * g} for g in groups]}


def summary(values: list[float], digits: int) -> dict:
    return {"min": round(min(values), digits), "median": round(statistics.median(values), digits),
            "values": [round(v, digits) for v in values]}


def measure(model: str, dtype: str, *, tokens: int, prompt_len: int, lengths: list[int], prompts: int,
            groups: list[int], group_len: int, budget: int, reps: int, mm_size: int = MM_SIZE, log=None) -> dict:
    from bench.limits import Machine
    from bench.train_memory import Meter
    from bench.train_mfu import matmul_params
    from relax.config.compose import load_config
    from relax.data.tokenizer import load_tokenizer
    from relax.roles.workers import ModelInfo, PolicyWorker

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    load = load_average()
    curves = points(tokens, prompt_len, lengths, prompts, groups, group_len)
    out: dict = {"bench": "cost_growth", "model": model, "dtype": dtype, "prompt_len": prompt_len, "tokens": tokens,
                 "budget": budget, "spread": SPREAD, "reps": reps, "length": [], "group": []}
    for curve in curves.values():
        for p in curve:
            p["pad"], p["pack"] = {}, {}
    machine = None
    for side in ("pad", "pack"):
        # micro-batches by tokens only: the row limits as high as any batch here
        cfg = load_config([f"model={model}", f"model.dtype={dtype}", "rollout.rollout_batch_size=512",
                           "rollout.n_samples_per_prompt=8", "train.global_batch_size=4096",
                           "train.micro_batch_size=4096", f"train.max_tokens_per_micro_batch={budget}",
                           f"train.pack_sequences={str(side == 'pack').lower()}", "tracking.enabled=false"])
        tok = load_tokenizer(cfg.model)
        worker = PolicyWorker(cfg, ModelInfo(len(tok), tok.pad_token_id, ()))
        meter = Meter(worker.policy.device)
        if machine is None:
            machine = Machine.measure(worker.policy.compute_dtype, mm_size)
            out["matmul_params"] = matmul_params(worker.policy.model)
            out["peak_flops"] = machine.peak_flops
        worker.train_step(spread_batch(len(tok), 2, prompt_len, lengths[0])[0])  # AdamW's state
        for name, curve in curves.items():
            for p in curve:
                batch, real = spread_batch(len(tok), p["rows"], prompt_len, p["L"])
                times, acts = [], []
                for _ in range(reps):
                    before = meter.now()
                    meter.reset()
                    t0 = time.perf_counter()
                    worker.train_step(batch)
                    synchronize(worker.policy.device)
                    times.append(time.perf_counter() - t0)
                    acts.append((meter.peak() - before) / 1024)
                p["tokens"], p["padded_tokens"] = real, p["rows"] * (prompt_len + p["L"])
                p["limit_s"] = 6 * out["matmul_params"] * real / machine.peak_flops
                p[side] = {"time_s": summary(times, 3), "activation_mib": summary(acts, 1)}
                log(f"  [growth {model} {side} {name} L={p['L']} rows={p['rows']}] {statistics.median(times):.2f} s, "
                    f"activation {statistics.median(acts):.0f} MiB")
        del worker
    out["length"], out["group"] = curves["length"], curves["group"]
    out["threads"] = torch.get_num_threads()
    out["load_average"] = load
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m", choices=["tiny", "smollm2_135m"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=2048, help="real tokens of a step on the length curve")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    ap.add_argument("--prompts", type=int, default=4, help="prompts of a step on the group curve")
    ap.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--group-len", type=int, default=64, help="response length on the group curve")
    ap.add_argument("--budget", type=int, default=1024, help="train.max_tokens_per_micro_batch")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--mm-size", type=int, default=MM_SIZE,
                    help="square matmuls that measure the machine's limit (smaller: the caches, for smoke runs)")
    a = ap.parse_args(argv)
    r = measure(a.model, a.dtype, tokens=a.tokens, prompt_len=a.prompt_len, lengths=a.lengths, prompts=a.prompts,
                groups=a.groups, group_len=a.group_len, budget=a.budget, reps=a.reps, mm_size=a.mm_size)
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
