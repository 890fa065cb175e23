"""LoRA against full fine-tuning, the same work side by side: actor memory and train step, weight updates, and the
Ray loop end to end.

    python bench/lora.py --model smollm2_135m --rank 16

- memory and train step: bench/train_memory.py in a fresh process per side (its peak resident set is the side's
  own), `--lora-rank` 0 and `rank`, without and with gradient checkpointing;
- weight updates: the actor's `weights()` (merged for full fine-tuning and `rollout.lora_sync=merged`, the adapters
  alone for `adapter`) and an embedded engine's `load_weights` of them, alternating the three, `reps` times each:
  bytes and seconds;
- end to end: `relax-train`'s loop (real Ray, `relax.runner.train.run`) for `steps` steps of GRPO on the
  arithmetic task, each side, samples per second over the steps after the first.

One JSON line on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_average, run_script


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def memory(model: str, rank: int, *, rows: int, prompt_len: int, response_len: int, micro: int, reps: int,
           checkpointing: bool = False, fresh: bool = True) -> dict:
    """bench/train_memory.py's measurement of one side; `fresh`: in a process of its own (`run_script`)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    argv = [f"--model={model}", "--dtype=float32", f"--rows={rows}", f"--prompt-len={prompt_len}",
            f"--response-len={response_len}", f"--micro={micro}", f"--reps={reps}",
            f"--lora-rank={rank}"] + (["--gradient-checkpointing"] if checkpointing else [])
    r = run_script("train_memory", argv, fresh=fresh, env=env)
    r["command"] = "MALLOC_MMAP_THRESHOLD_=65536 python bench/train_memory.py " + " ".join(argv)
    return r


def sync(model: str, rank: int, reps: int) -> dict:
    """Bytes and seconds of a weight update, full / LoRA merged / LoRA adapter, alternating."""
    import torch

    from relax.config.compose import load_config
    from relax.data.tokenizer import load_tokenizer
    from relax.models.hf import build_model
    from relax.models.weight_buffers import WeightBuffers
    from relax.roles.workers import ModelInfo, PolicyWorker
    from relax.rollout.embedded import EmbeddedEngine

    sides = {"full": [], "lora merged": [f"model.lora_rank={rank}"],
             "lora adapter": [f"model.lora_rank={rank}", "rollout.lora_sync=adapter"]}
    workers, engines = {}, {}
    for name, extra in sides.items():
        cfg = load_config([f"model={model}", "model.dtype=float32", "tracking.enabled=false", *extra])
        tok = load_tokenizer(cfg.model)
        info = ModelInfo(len(tok), tok.pad_token_id, ())
        workers[name] = PolicyWorker(cfg, info)
        net = build_model(cfg.model, info.vocab_size, info.pad_token_id, seed=cfg.seed, dtype=torch.float32)
        keys = []
        if name == "lora adapter":
            from relax.models.lora import inject_adapters

            keys = inject_adapters(net, cfg.model)
        engines[name] = EmbeddedEngine(net, eos_token_ids=[], pad_token_id=info.pad_token_id, device="cpu")
        engines[name].adapter_keys = frozenset(keys)
    out: dict = {name: {"seconds": []} for name in sides}
    for rep in range(reps):
        for name in sides:
            t0 = time.perf_counter()
            weights = workers[name].weights(rep)
            assert isinstance(weights, WeightBuffers)
            engines[name].load_weights(weights.tensors(), rep)
            out[name]["seconds"].append(time.perf_counter() - t0)
            out[name]["bytes"] = weights.nbytes
    for name in sides:
        out[name]["median_s"] = round(statistics.median(out[name]["seconds"]), 4)
    return out


def end_to_end(model: str, rank: int, steps: int) -> dict:
    """samples/s of `steps` GRPO steps through the Ray loop, full and LoRA (the first step left out: start-up)."""
    import tempfile

    from relax.config.compose import load_config
    from relax.runner.train import run

    out = {}
    for name, extra in (("full", []), ("lora", [f"model.lora_rank={rank}", "train.lr=2e-4"])):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config([f"model={model}", "model.dtype=float32", "data=arithmetic",
                               "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                               "rollout.max_response_len=24", f"train.num_rollout={steps}", "train.save=false",
                               "tracking.enabled=false", "tracking.progress=false", *extra])
            result = run(cfg, output_dir=Path(tmp))
        times = result.series("perf/step_time")[1:]
        samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        out[name] = {"samples_per_s": round(samples * len(times) / sum(times), 3),
                     "step_s": [round(t, 2) for t in times],
                     "sync_bytes": result.series("perf/sync_bytes")[-1]}
        _log(f"  [lora e2e {name}] {out[name]['samples_per_s']} samples/s")
    return out


def compare(model: str = "smollm2_135m", rank: int = 16, *, rows: int = 16, prompt_len: int = 32,
            response_len: int = 96, micro: int = 8, reps: int = 3, sync_reps: int = 5, steps: int = 5,
            checkpointing: bool = True, fresh_processes: bool = True) -> dict:
    """`checkpointing`: also measure both sides with gradient checkpointing (a process each). `fresh_processes`:
    each memory side in a process of its own (False: in this one, for smoke runs: `bench.common.run_script`)."""
    load = load_average()
    mem = {}  # each side without and with gradient checkpointing (activations dominate without it)
    for ckpt in (False, True) if checkpointing else (False,):
        for name, r in (("full", 0), ("lora", rank)):
            key = name + (" checkpointing" if ckpt else "")
            mem[key] = memory(model, r, rows=rows, prompt_len=prompt_len, response_len=response_len, micro=micro,
                              reps=reps, checkpointing=ckpt, fresh=fresh_processes)
            _log(f"  [lora memory {key}] peak {mem[key]['peak_total_mib']:.0f} MiB, step "
                 f"{mem[key]['time_s']['median']} s")
    return {"bench": "lora", "model": model, "rank": rank, "memory": mem, "sync": sync(model, rank, sync_reps),
            "end_to_end": end_to_end(model, rank, steps) if steps else None, "load_average": [load, load_average()]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m", choices=["tiny", "smollm2_135m"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sync-reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="end-to-end steps per side (0: skip)")
    a = ap.parse_args(argv)
    print(json.dumps(compare(a.model, a.rank, rows=a.rows, prompt_len=a.prompt_len, response_len=a.response_len,
                             micro=a.micro, reps=a.reps, sync_reps=a.sync_reps, steps=a.steps)), flush=True)


if __name__ == "__main__":
    main()
