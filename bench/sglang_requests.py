"""rollout=sglang's request shape, measured: one request per sample vs one per prompt (`n` = group size), through the
real sglang-router to one relax-serve process, against the same engine called in-process.

The same prompts, group size and new tokens on all three sides; sides alternate, `--reps` times each after a
warm-up. tokens/s = generated tokens / wall time of the whole batch (HTTP, JSON and the router included for the
two HTTP sides). Per-sample requests give every sample its own `sampling_seed` (reproducible, retried exactly);
per-prompt requests with n>1 cannot (SGLang gives the n copies one seed), and let the server prefill a prompt
once for its group.

    python bench/sglang_requests.py --prompts 8 --group 8 --new-tokens 32 --reps 3
    python bench/sglang_requests.py model=smollm2_135m model.source=gguf      # any relax-train override
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Series, Timer, alternate, ratio_series


def compare(overrides: list[str], *, prompts: int, group: int, new_tokens: int, reps: int, threads: int,
            log=print) -> dict[str, Series]:
    import torch

    from relax.config import load_config
    from relax.data.tokenizer import load_tokenizer
    from relax.models.hf import build_model, pick_device, pick_dtype
    from relax.rollout.embedded import EmbeddedEngine
    from relax.rollout.sglang.client import GenerateClient, Sampling, generate_payload, sample_seed
    from relax.rollout.sglang.process import free_port, start_process, stop_process, wait_healthy
    from relax.rollout.sglang.router import Router

    cfg = load_config([*overrides, "rollout=sglang", "rollout.sglang.server=embedded",
                       f"rollout.max_response_len={new_tokens}"])
    tok = load_tokenizer(cfg.model)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, len(tok), (16,), generator=g).tolist() for _ in range(prompts)]
    sampling = Sampling(new_tokens, 1.0, 1.0, -1, ())

    tmp = Path(tempfile.mkdtemp(prefix="relax-bench-sglang-"))
    (tmp / "cfg.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    port = free_port()
    server = start_process([sys.executable, "-m", "relax.cli.serve", "--port", str(port), "--threads", str(threads),
                            "--config", str(tmp / "cfg.json")], tmp / "serve.log")
    router = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url + "/health", server, 300, what="relax-serve", log_path=tmp / "serve.log")
        router = Router(host="127.0.0.1", policy="cache_aware", log_path=tmp / "router.log", startup_timeout_s=60,
                        request_timeout_s=600).start()
        router.add(url)
        client = GenerateClient(router.url, request_timeout_s=600)
        device = pick_device()
        torch.set_num_threads(threads)
        model = build_model(cfg.model, len(tok), tok.pad_token_id, seed=cfg.seed, dtype=pick_dtype(cfg.model, device),
                            device=device)
        engine = EmbeddedEngine(model.eval(), eos_token_ids=[], pad_token_id=tok.pad_token_id, device=device)
        tokens = prompts * group * new_tokens

        def in_process(rep: int) -> float:
            with Timer() as t:
                engine.generate(rows, n_samples_per_prompt=group, max_new_tokens=new_tokens, seed=rep)
            return tokens / t.seconds

        def payload(row: list[int], seed: int) -> dict:
            p = generate_payload(row, sampling, max_new_tokens=new_tokens, seed=seed)
            p["sampling_params"]["ignore_eos"] = True  # exactly new_tokens per sample on every side
            return p

        def per_sample(rep: int) -> float:
            payloads = [payload(r, sample_seed(rep, i * group + k, 0))
                        for i, r in enumerate(rows) for k in range(group)]
            with Timer() as t:
                answers = client.generate(payloads)
            assert sum(len(a["meta_info"]["output_token_logprobs"]) for a in answers) == tokens
            return tokens / t.seconds

        def per_prompt(rep: int) -> float:
            payloads = []
            for r in rows:
                p = payload(r, 0)
                p["sampling_params"].update(n=group)
                del p["sampling_params"]["sampling_seed"]
                payloads.append(p)
            with Timer() as t:
                client.generate(payloads)  # the client keeps the first of each list: the count is the server's
            return tokens / t.seconds

        res = alternate({"in_process": in_process, "per_sample": per_sample, "per_prompt": per_prompt}, reps)
        for name, s in res.items():
            log(f"sglang requests {name}: {s.median:.0f} tokens/s ({s.spread})")
        res["per_sample_vs_in_process"] = ratio_series(res["per_sample"], res["in_process"])
        res["per_sample_vs_per_prompt"] = ratio_series(res["per_sample"], res["per_prompt"])
        return res
    finally:
        if router is not None:
            router.stop()
        stop_process(server)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("overrides", nargs="*", default=["model=tiny"])
    a = p.parse_args()
    compare(a.overrides, prompts=a.prompts, group=a.group, new_tokens=a.new_tokens, reps=a.reps, threads=a.threads)


if __name__ == "__main__":
    main()
