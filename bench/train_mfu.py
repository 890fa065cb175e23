"""Train phase against the machine's limit: achieved FLOP/s of the policy's forward+backward / measured matmul FLOP/s.

Achieved: 6 * N_params * tokens per optimizer step, where N_params counts every parameter that takes
part in a token's matmuls (the tied embedding counted once, as the lm_head matmul; the embedding lookup
and attention's QK^T/AV are NOT counted, so this slightly under-states the work) and tokens are all
non-padding prompt+response tokens of the step (the forward runs over the prompt too). The time is
`TorchPolicy.train_step` (forward, backward, optimizer) on a fixed batch, on the device the trainer picks (the
GPU when there is one). Limit: torch.mm of two square matrices of `--mm-size` in the same dtype (bf16 for
autocast, fp32 otherwise), on the same device and threads; on a GPU also the datasheet bf16 peak (MFU).

    python bench/train_mfu.py --model smollm2_135m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Series, datasheet_bf16_flops, random_train_batch, synchronize


def matmul_flops(dtype: torch.dtype, size: int, reps: int, device: torch.device | str = "cpu") -> Series:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)
    synchronize(device)
    out = Series()
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        out.values.append(2 * size**3 / (time.perf_counter() - t0))
    return out


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters used in matmuls per token: all 2-D weights except the embedding unless it is the lm_head too."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = 0
    for p in model.parameters():
        if p.dim() < 2:
            continue
        if p is emb and head is not emb:
            continue  # a lookup, not a matmul
        total += p.numel()
    if head is not emb and all(head is not p for p in model.parameters()):
        total += head.numel()
    return total


def measure(model_name: str, dtype: str, *, rows: int, prompt_len: int, response_len: int, micro: int, reps: int,
            mm_size: int, log=print) -> dict:
    from relax.config.compose import load_config
    from relax.data.tokenizer import load_tokenizer
    from relax.roles.workers import ModelInfo, PolicyWorker

    cfg = load_config([f"model={model_name}", f"model.dtype={dtype}", f"train.micro_batch_size={micro}",
                       "tracking.enabled=false"])
    tok = load_tokenizer(cfg.model)
    worker = PolicyWorker(cfg, ModelInfo(len(tok), tok.pad_token_id, ()), threads=None)
    policy = worker.policy
    V = len(tok)
    batch = random_train_batch(V, rows, prompt_len, response_len)
    n_params = matmul_params(policy.model)
    tokens = rows * (prompt_len + response_len)
    flops_step = 6 * n_params * tokens
    device = policy.device
    worker.train_step(batch)  # warm-up
    mm_dtype = policy.compute_dtype
    achieved, limit = Series(), Series()
    for rep in range(reps):  # alternate: one train step, then a matmul measurement
        synchronize(device)
        t0 = time.perf_counter()
        worker.train_step(batch)
        synchronize(device)
        achieved.values.append(flops_step / (time.perf_counter() - t0))
        limit.values.append(matmul_flops(mm_dtype, mm_size, 3, device).median)
        log(f"  [{model_name} {dtype}] rep {rep}: train {achieved.values[-1] / 1e9:.1f} GFLOP/s, "
            f"mm {limit.values[-1] / 1e9:.1f} GFLOP/s")
    frac = Series([a / m for a, m in zip(achieved.values, limit.values, strict=True)])
    peak = datasheet_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    mfu = None if peak is None else Series([a / peak for a in achieved.values])
    return {"model": model_name, "dtype": dtype, "compute_dtype": str(mm_dtype).replace("torch.", ""),
            "device": str(device), "mfu": mfu,
            "matmul_params": n_params, "tokens": tokens, "rows": rows, "micro": micro,
            "achieved": achieved, "limit": limit, "fraction": frac, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m", choices=["tiny", "smollm2_135m"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mm-size", type=int, default=2048)
    a = ap.parse_args()
    r = measure(a.model, a.dtype, rows=a.rows, prompt_len=a.prompt_len, response_len=a.response_len, micro=a.micro,
                reps=a.reps, mm_size=a.mm_size)
    print(f"train {r['achieved'].median / 1e9:.1f} GFLOP/s, matmul {r['limit'].median / 1e9:.1f} GFLOP/s, "
          f"fraction {r['fraction'].median:.2f} ({r['fraction'].spread})")


if __name__ == "__main__":
    main()
