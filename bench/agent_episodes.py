"""Agentic episodes on the embedded engine: every turn inside one generation (the KV cache of earlier turns kept,
observations fed as tokens) against a turn per call (each turn's whole context prefilled again, as an engine without
a cache across calls does), on the same episodes.

Both sides play `guess_number` with the same random streams (a token's draw is keyed by sample and position), so
they produce the same tokens up to float rounding (a context computed in one forward or in several can move a draw
that falls on a boundary between two tokens): the script checks that at least 90% of the episodes are identical,
then reports episodes/s and the context tokens the in-engine side did not compute again. Sides alternate, `--reps`
times each after a warm-up.

    python bench/agent_episodes.py --model tiny --prompts 8 --group 8 --turns 5
    python bench/agent_episodes.py --model smollm2_135m --prompts 4 --group 4 --turns 4 --turn-len 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Timer, alternate, ratio_series

OBS_ROOM = 16  # tokens per observation the episode budget allows for


def compare(model: str, *, prompts: int, group: int, turns: int, turn_len: int, reps: int, threads: int,
            log=print) -> dict:
    from relax.agents.episode import EpisodeMaker
    from relax.batch import Samples
    from relax.config import load_config
    from relax.data.datasets import build_datasets
    from relax.data.tokenizer import load_tokenizer, stop_token_ids
    from relax.models.hf import build_model
    from relax.rollout.embedded import EmbeddedEngine

    torch.set_num_threads(threads)
    limit = turns * (turn_len + OBS_ROOM)
    cfg = load_config([f"model={model}", "model.dtype=float32", "data=guess_number", f"rollout.max_turns={turns}",
                       f"rollout.max_response_len={turn_len}", f"rollout.max_episode_tokens={limit}"])
    tok = load_tokenizer(cfg.model)
    items = list(build_datasets(cfg, tok)[0])[:prompts]
    net = build_model(cfg.model, len(tok), tok.pad_token_id, seed=cfg.seed, dtype=torch.float32, device="cpu")
    engine = EmbeddedEngine(net.eval(), eos_token_ids=list(stop_token_ids(cfg.model, tok)),
                            pad_token_id=tok.pad_token_id)
    maker = EpisodeMaker.for_config(cfg)
    N = prompts * group
    ids = torch.arange(N)

    def in_engine(rep: int) -> Samples:
        return engine.generate([i.prompt_ids for i in items], n_samples_per_prompt=group, max_new_tokens=limit,
                               seed=rep, episodes=maker.new_for(items, group), turn_limit=turn_len)

    def turn_per_call(rep: int) -> list[list[int]]:
        """Each round, every running episode's next turn from its whole context (no cache across calls)."""
        episodes = maker.new_for(items, group)
        context = [list(items[r // group].prompt_ids) for r in range(N)]
        start = [len(c) for c in context]
        live = list(range(N))
        while live:
            pos = torch.tensor([len(context[r]) - start[r] for r in live])
            budget = torch.tensor([min(turn_len, limit - int(p)) for p in pos])
            out = engine.generate([context[r] for r in live], max_new_tokens=turn_len, seed=rep,
                                  sample_ids=ids[live], positions=pos, budgets=budget)
            going = []
            for k, r in enumerate(live):
                n = int(out.response_mask[k].sum())
                turn = out.response_ids[k, :n].tolist()
                context[r] += turn
                if len(context[r]) - start[r] >= limit:
                    continue
                stop = turn[-1] if out.finish_reason[k] == "stop" else None
                obs = episodes[r].turn_end(turn, stop, len(context[r]))
                if obs is not None and len(context[r]) - start[r] + len(obs) < limit:
                    context[r] += obs
                    going.append(r)
            live = going
        return [c[s:] for c, s in zip(context, start, strict=True)]

    # the same episodes on both sides
    a, b = in_engine(0), turn_per_call(0)
    same = sum(a.response_ids[r, :int(a.present()[r].sum())].tolist() == b[r] for r in range(N))
    if same < 0.9 * N:
        raise AssertionError(f"only {same} of {N} episodes are the same on both sides: they do not do the same work")
    tokens = int(a.present().sum())
    reused = sum(e["kv_reused"] for e in a.episodes)
    turns_mean = sum(e["turns"] for e in a.episodes) / N

    def timed(fn):
        def run(rep: int) -> float:
            with Timer() as t:
                fn(rep)
            return N / t.seconds
        return run

    res = alternate({"in_engine": timed(in_engine), "turn_per_call": timed(turn_per_call)}, reps)
    res["speedup"] = ratio_series(res["in_engine"], res["turn_per_call"])
    log(f"agent episodes {model}: in-engine {res['in_engine'].median:.1f} episodes/s, a turn per call "
        f"{res['turn_per_call'].median:.1f}, speedup {res['speedup'].median:.2f}x ({turns_mean:.2f} turns/episode)")
    maker.close()
    return {**res, "episodes": N, "same": same, "tokens": tokens, "reused": reused, "turns_mean": turns_mean,
            "limit": limit}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--turn-len", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    compare(a.model, prompts=a.prompts, group=a.group, turns=a.turns, turn_len=a.turn_len, reps=a.reps,
            threads=a.threads)


if __name__ == "__main__":
    main()
