"""Weight loads on the rollout's critical path: a copy (`load_weights`) vs a swap of weights staged beside
generation (`rollout.stage_weights`: `stage_weights` while a batch generates, then `load_weights` swaps them in).

One embedded engine in this process. Per rep: the copy load of a new version (the pump's wait without staging);
then a generation alone, the same generation with a staging copy in a second thread (what staging costs the
generation it hides behind, on the same cores), and the swap (the pump's wait with staging). Medians over reps.

    python bench/weight_staging.py                       # SmolLM2-135M fp32
    python bench/weight_staging.py --model tiny --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(model: str = "smollm2_135m", reps: int = 5, batch: int = 8, new_tokens: int = 32) -> dict:
    import torch

    from relax.config import load_config
    from relax.models.hf import build_model
    from relax.rollout.embedded import EmbeddedEngine

    cfg = load_config([f"model={model}", "model.dtype=float32"])
    vocab = 49152 if model.startswith("smollm2") else 256
    engine = EmbeddedEngine(build_model(cfg.model, vocab, 0, seed=0), eos_token_ids=[-1], pad_token_id=0)
    state = engine.model.state_dict()
    versions = [{k: v * (1 + 1e-3 * s) for k, v in state.items()} for s in (1, 2)]  # two other versions
    prompts = [[5 + i, 6, 7, 8] for i in range(batch)]

    def generate() -> float:
        t0 = time.perf_counter()
        engine.generate(prompts, max_new_tokens=new_tokens, temperature=1.0, seed=0)
        return time.perf_counter() - t0

    generate()  # warm-up (fuses the fast path's weights)
    out: dict[str, list[float]] = {"copy_s": [], "swap_s": [], "stage_s": [], "generate_s": [],
                                   "generate_while_staging_s": []}
    version = 0
    for rep in range(reps):
        version += 1
        t0 = time.perf_counter()
        engine.load_weights(versions[rep % 2], version)
        out["copy_s"].append(time.perf_counter() - t0)
        out["generate_s"].append(generate())
        version += 1
        staged: list[float] = []

        def stage(state: dict = versions[(rep + 1) % 2], v: int = version, staged: list = staged) -> None:
            t = time.perf_counter()
            engine.stage_weights(state, v)
            staged.append(time.perf_counter() - t)

        thread = threading.Thread(target=stage)
        thread.start()
        out["generate_while_staging_s"].append(generate())
        thread.join()
        out["stage_s"].append(staged[0])
        t0 = time.perf_counter()
        engine.load_weights(versions[(rep + 1) % 2], version)
        out["swap_s"].append(time.perf_counter() - t0)
    assert engine.swapped_loads == reps
    nbytes = sum(t.numel() * t.element_size() for t in {id(p): p for p in engine.model.parameters()}.values())
    return {"model": model, "threads": torch.get_num_threads(), "weights_mib": nbytes / 2**20, "reps": reps,
            **{k: statistics.median(v) for k, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    r = measure(a.model, a.reps)
    print(f"{r['model']} ({r['weights_mib']:.0f} MiB of weights, {r['threads']} threads, median of {r['reps']}): "
          f"load by copy {r['copy_s'] * 1e3:.1f} ms, by swap {r['swap_s'] * 1e3:.2f} ms; staging copy "
          f"{r['stage_s'] * 1e3:.1f} ms beside a generation of {r['generate_s']:.2f} s alone, "
          f"{r['generate_while_staging_s']:.2f} s while staging")


if __name__ == "__main__":
    main()
