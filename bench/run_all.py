"""The Relax performance suite: every benchmark, both sides side by side, one report.

    python -m bench                      # full suite (~30-60 min on 2 CPU cores), writes docs/performance.md
    python -m bench --quick              # smaller sizes, fewer repetitions (~10 min)
    python -m bench --smoke --out /tmp/perf.md   # tiny sizes only, seconds (what tests/bench runs)
    python -m bench --only rollout,math  # some sections: rl, rollout, train, memory, overhead, modes, sglang,
                                         # agents, math

    bash bench/gpu.sh                    # on a CUDA device: the sections that run there, docs/performance_gpu.md

Each comparison runs both sides in the same process, alternating, several repetitions; the report gives
medians, min-max spreads and the load average before and after each section (the machine may be shared), each
target row's verdict, and the headlines against those of the report it replaces (bench/verdicts.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Series, load_average, machine_info, run_script
from bench.verdicts import MMAP_THRESHOLD, ROUND1_PEAK_MIB, Headlines, comparison, previous, verdict

SECTIONS = ("rl", "rollout", "train", "memory", "growth", "overhead", "modes", "sglang", "agents", "math",
            "lora")
TARGETS = {
    "rl": "Relax samples/s >= 2x TRL, both sizes, same precision; a step <= 1.3x its limit on the machine "
          "(FLOPs at the matmul peak, decode at memory bandwidth); with variable-length responses (spread >= 4x) at "
          "135M fp32, >= 2x TRL's tokens/s",
    "rollout": "engine tokens/s >= 2x HF generate on the tiny model, >= 2.5x at 135M bf16",
    "train": "135M train phase in bf16 >= 60% of the measured bf16 matmul FLOP/s (round 4; fp32: >= 50% of fp32's, "
             "round 3)",
    "memory": "actor peak memory at 135M, 16 x 128 tokens, <= 40% of round 1's",
    "growth": "at a fixed token budget per micro-batch, actor memory grows no faster than linearly with the response "
              "length (packed and padded); step time against the step's limit as responses and groups double",
    "overhead": "overhead <= 5% of a step at 135M, <= 10% on the tiny model; start-up to step 0 <= 8 s (tiny), "
                "<= 15 s (135M)",
    "modes": "with the rollout and the actor on disjoint cores (cluster.role_cores) and balanced work: fully_async >= "
             "1.8x and hybrid >= 1.5x sync samples/s (round 4); on shared cores measured, no target (both phases use "
             "both cores in sync)",
    "sglang": "no target: the request shape of rollout=sglang, measured (per sample vs per prompt)",
    "agents": "no target: agentic episodes with the KV cache kept across turns vs a turn per call, measured",
    "math": "1M-token M2PO solve < 25 ms; every compute_loss fwd+bwd within 1.5x of the cheapest",
    "lora": "LoRA rank 16 at 135M fp32: actor peak memory <= 50% of full fine-tuning's; an adapter weight update "
            ">= 20x smaller than a full one",
}


@dataclass
class Settings:
    rl_runs: list[tuple[str, str, dict]]  # (model, dtype, kwargs of rl_vs_trl.compare)
    rollout_runs: list[dict]
    train_runs: list[dict]
    memory_runs: list[dict]  # arguments of bench/train_memory.py, each run in a fresh process
    growth_runs: list[dict]  # arguments of bench/cost_growth.py, each run in a fresh process
    overhead_runs: list[tuple]  # (overrides, steps[, Ray already running])
    # (work overrides, steps, reps, modes) of bench/async_modes.py
    modes_runs: list[tuple[list[str], int, int, tuple[str, ...]]]
    sglang_runs: list[tuple[list[str], dict]]  # (model overrides, kwargs of bench/sglang_requests.compare)
    agent_runs: list[dict]  # kwargs of bench/agent_episodes.compare
    math_tokens: int
    math_reps: int
    lora_runs: list[dict] = field(default_factory=list)  # kwargs of bench/lora.py's compare
    # False (smoke): the memory, growth and LoRA sections run their scripts' main in this process
    # (bench.common.run_script: same arguments and JSON, no other interpreter to start; its peaks are the suite's)
    fresh_processes: bool = True


def without_slow_bf16(st: Settings) -> tuple[Settings, bool]:
    """`st` without its bfloat16 rows on a CPU without native bf16 matmul (AVX512-BF16/AMX), where bf16 is
    emulated at a small fraction of fp32's speed and a single step takes minutes; (settings, rows dropped)."""
    import torch

    from relax.models.hf import cpu_has_fast_bf16

    if torch.cuda.is_available() or cpu_has_fast_bf16():
        return st, False

    def fp32(runs: list, dtype_of) -> list:
        return [r for r in runs if dtype_of(r) != "bfloat16"]

    slim = dataclasses.replace(
        st, rl_runs=fp32(st.rl_runs, lambda r: r[1]), rollout_runs=fp32(st.rollout_runs, lambda r: r["dtype"]),
        train_runs=fp32(st.train_runs, lambda r: r["dtype"]), memory_runs=fp32(st.memory_runs, lambda r: r["dtype"]))
    return slim, slim != st


def settings(mode: str) -> Settings:
    from bench import async_modes

    if mode == "smoke":
        # mm_size: the machine's limit from small matmuls (bench/limits.py; 2048 otherwise)
        rl = dict(prompts=2, group=2, completion_len=4, micro=4, blocks=1, steps_per_block=2, mm_size=256)
        return Settings(
            rl_runs=[("tiny", "float32", rl), ("tiny", "float32", dict(rl, variable=True))],
            rollout_runs=[dict(model="tiny", batch=4, n_samples=2, prompt_len=8, new_tokens=4, reps=1,
                               dtype="float32")],
            train_runs=[dict(model_name="tiny", dtype="float32", rows=4, prompt_len=8, response_len=8, micro=4,
                             reps=1, mm_size=256)],
            memory_runs=[dict(model="tiny", dtype="float32", rows=4, prompt_len=8, response_len=8, micro=4, reps=1)],
            growth_runs=[dict(model="tiny", dtype="float32", tokens=96, prompt_len=8, lengths=[8, 16], prompts=2,
                              groups=[2, 4], group_len=8, budget=64, reps=1, mm_size=256)],
            # one Ray for every run of the smoke suite (`main`): the overhead row says so
            overhead_runs=[(["model=tiny", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
                             "rollout.max_response_len=4", "train.micro_batch_size=4"], 2, True)],
            modes_runs=[(["model=tiny", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
                          "rollout.max_response_len=4", "train.micro_batch_size=4"], 3, 1, ("sync", "fully_async"))],
            sglang_runs=[(["model=tiny"], dict(prompts=2, group=2, new_tokens=4, reps=1))],
            agent_runs=[dict(model="tiny", prompts=2, group=2, turns=3, turn_len=2, reps=1)],
            math_tokens=4096, math_reps=1,
            lora_runs=[dict(model="tiny", rank=4, rows=4, prompt_len=8, response_len=8, micro=4, reps=1,
                            sync_reps=1, steps=0, checkpointing=False)],
            fresh_processes=False,
        )
    quick = mode == "quick"
    tiny = dict(prompts=8, group=8, completion_len=8, micro=8, blocks=2 if quick else 3, steps_per_block=4)
    smol = dict(prompts=2 if quick else 4, group=4, completion_len=16 if quick else 32, micro=8,
                blocks=2 if quick else 3, steps_per_block=2)
    rl_runs = [("tiny", "float32", tiny), ("smollm2_135m", "bfloat16", smol)]
    if not quick:
        rl_runs.append(("smollm2_135m", "float32", dict(smol, completion_len=16)))
    # round 3's target: variable-length responses (stopping at EOS), tokens/s
    rl_runs.append(("smollm2_135m", "float32", dict(smol, completion_len=64, variable=True)))
    reps = 3 if quick else 5
    return Settings(
        rl_runs=rl_runs,
        rollout_runs=[
            dict(model="tiny", batch=16, n_samples=4, prompt_len=32, new_tokens=64, reps=reps, dtype="float32"),
            dict(model="smollm2", batch=4 if quick else 8, n_samples=4, prompt_len=32, new_tokens=32, reps=reps,
                 dtype="bfloat16"),
            dict(model="smollm2", batch=4 if quick else 8, n_samples=4, prompt_len=32, new_tokens=32, reps=reps,
                 dtype="float32"),
        ],
        train_runs=[dict(model_name="smollm2_135m", dtype="bfloat16", rows=8 if quick else 16, prompt_len=32,
                         response_len=64,
                         micro=8, reps=reps, mm_size=2048)]
        + ([] if quick else [dict(model_name="smollm2_135m", dtype="float32", rows=8, prompt_len=32,
                                  response_len=64, micro=8, reps=3, mm_size=2048)]),
        memory_runs=[dict(model="smollm2_135m", dtype=dtype, rows=16, prompt_len=32, response_len=96, micro=8,
                          reps=2 if quick else 3) for dtype in ("float32", "bfloat16")]
        + ([] if quick else [dict(model="smollm2_135m", dtype="float32", rows=16, prompt_len=32, response_len=96,
                                  micro=8, reps=2, gradient_checkpointing=True)]),
        growth_runs=[dict(model="smollm2_135m", dtype="float32", tokens=1024, prompt_len=16,
                          lengths=[32, 64, 128, 256] if quick else [32, 64, 128, 256, 512], prompts=2,
                          groups=[2, 4, 8] if quick else [2, 4, 8, 16], group_len=64, budget=1024,
                          reps=1 if quick else 2)],
        overhead_runs=[(["model=tiny"], 8 if quick else 12), (["model=tiny"], 3, True)]
        + ([] if quick else [(["model=smollm2_135m", "data=arithmetic", "rollout.rollout_batch_size=4",
                               "rollout.n_samples_per_prompt=4", "rollout.max_response_len=32"], 4)]),
        modes_runs=[(async_modes.WORK, 10 if quick else 16, 1 if quick else 2, tuple(async_modes.MODES))]
        # the rollout and the actor on disjoint cores (cluster.role_cores), where overlap can pay; on one core each the
        # engine is relatively slower, so shorter responses balance the phases (sync's idle shares: ~50% each)
        + ([(async_modes.DISJOINT_WORK + [cores], 10 if quick else 16, 1 if quick else 2,
             ("sync", "hybrid", "fully_async", "fully_async_rollout_logp"))]
           if (cores := async_modes.disjoint_cores()) is not None else []),
        sglang_runs=[(["model=tiny"], dict(prompts=8, group=8, new_tokens=32, reps=reps)),
                     (["model=smollm2_135m", "model.source=gguf"], dict(prompts=4, group=8, new_tokens=32, reps=3))],
        agent_runs=[dict(model="tiny", prompts=8, group=8, turns=5, turn_len=2, reps=reps),
                    dict(model="smollm2_135m", prompts=4, group=4, turns=4, turn_len=8, reps=3)],
        math_tokens=1024 * 1024, math_reps=3 if quick else 5,
        lora_runs=[dict(model="tiny", rank=16, rows=16, prompt_len=32, response_len=96, micro=8, reps=reps,
                        sync_reps=reps, steps=6),
                   dict(model="smollm2_135m", rank=16, rows=16, prompt_len=32, response_len=96, micro=8,
                        reps=2 if quick else 3, sync_reps=3, steps=4 if quick else 6)],
    )


@dataclass
class Report:
    mode: str
    machine: dict[str, str]
    command: str
    sections: dict[str, list[str]] = field(default_factory=dict)  # name -> markdown lines
    loads: dict[str, tuple[str, str]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    headlines: Headlines = field(default_factory=Headlines)
    before: Headlines | None = None  # those of the report this run replaces


def fmt(s: Series, scale: float = 1.0, digits: int = 1) -> str:
    if not s.values:
        return "n/a"
    return (f"{s.median * scale:.{digits}f} ({min(s.values) * scale:.{digits}f}-{max(s.values) * scale:.{digits}f}"
            f", n={len(s.values)})")


def section_rl(st: Settings, log, h: Headlines) -> list[str]:
    from bench import rl_vs_trl

    lines = ["| model | precision | samples/step x tokens | Relax rate | TRL rate | ratio Relax/TRL | "
             "Relax phases (s): rollout / reward+adv / train / sync | limit (s): train / prefill / decode | "
             "Relax step / limit | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model, dtype, kw in st.rl_runs:
        r = rl_vs_trl.compare(model, dtype, log=log, **kw)
        ph, lim = r["relax_phases_s"], r["limit_s"]
        ratio, vs_limit = r["ratio"].median, r["vs_limit"].median
        variable = r["variable"]
        name = f"rl {model} {dtype}{' variable' if variable else ''}"
        h.add(f"{name}: Relax/TRL {r['unit']}", ratio, True)
        h.add(f"{name}: step / limit", vs_limit, False)
        if variable:  # responses stop at EOS: the target is on tokens/s, over a spread of at least 4x
            (a, b), (c, d) = r["lengths"]["relax"], r["lengths"]["trl"]
            spread = b / max(a, 1)
            work = (f"{r['samples_per_step']} x <= {r['completion_len']} (lengths {a}-{b} Relax, {c}-{d} TRL; "
                    f"{spread:.1f}x)")
            ok = None if spread < 4 else ratio >= 2.0
            need = ">= 2x TRL tokens/s" if spread >= 4 else ""
            cell = verdict(ok, need) + ("" if spread >= 4 else f" (the responses spread {spread:.1f}x, not 4x)")
        else:
            work = f"{r['samples_per_step']} x {r['completion_len']}"
            cell = verdict(ratio >= 2.0 and vs_limit <= 1.3, ">= 2x TRL and <= 1.3x the limit")
        lines.append(f"| {model} | {dtype} | {work} | {fmt(r['relax'], 1, 2)} {r['unit']}"
                     f" | {fmt(r['trl'], 1, 2)} | **{fmt(r['ratio'], 1, 2)}** | {ph['rollout']:.2f} / "
                     f"{ph['reward+adv']:.3f} / {ph['train']:.2f} / {ph['sync']:.3f} | {lim['train']:.3f} / "
                     f"{lim['prefill']:.3f} / {lim['decode']:.3f} | **{fmt(r['vs_limit'], 1, 2)}x** | {cell} |")
        cmd = (f"python bench/rl_vs_trl.py --model {model} --dtype {dtype} --prompts {kw['prompts']} --group "
               f"{kw['group']} --completion-len {kw['completion_len']} --micro {kw['micro']} --blocks {kw['blocks']}"
               f" --steps-per-block {kw['steps_per_block']}{' --variable' if variable else ''}"
               + (f" --mm-size {kw['mm_size']}" if "mm_size" in kw else ""))
        lines.append(f"| | | `{cmd}` | | | | | | | |")
    return lines


def section_rollout(st: Settings, log, h: Headlines) -> list[str]:
    from bench import rollout_vs_generate as rvg

    lines = ["| model | dtype | prompts x samples, prompt + new tokens | engine tok/s | generate tok/s | ratio | "
             "verdict |", "|---|---|---|---|---|---|---|"]
    for kw in st.rollout_runs:
        argv = ["--model", kw["model"], "--batch", str(kw["batch"]), "--n-samples", str(kw["n_samples"]),
                "--prompt-len", str(kw["prompt_len"]), "--new-tokens", str(kw["new_tokens"]), "--reps",
                str(kw["reps"]), "--dtype", kw["dtype"]]
        r = rvg.run(rvg.parser().parse_args(argv))
        e, g, q = Series(r["engine"]), Series(r["generate"]), Series(r["ratios"])
        log(f"  [rollout {kw['model']}] engine {e.median:.0f} tok/s, generate {g.median:.0f}, ratio {q.median:.2f}")
        h.add(f"rollout {kw['model']} {kw['dtype']}: engine/generate tok/s", q.median, True)
        need = 2.0 if kw["model"] == "tiny" else 2.5 if kw["dtype"] == "bfloat16" else None
        lines.append(f"| {kw['model']} | {kw['dtype']} | {kw['batch']} x {kw['n_samples']}, {kw['prompt_len']} + "
                     f"{kw['new_tokens']} | {fmt(e, 1, 0)} | {fmt(g, 1, 0)} | **{fmt(q, 1, 2)}** | "
                     f"{verdict(None if need is None else q.median >= need, f'>= {need}x')} |")
        lines.append(f"| | | `python bench/rollout_vs_generate.py {' '.join(argv)}` | | | | |")
    return lines


def section_train(st: Settings, log, h: Headlines) -> list[str]:
    from bench import train_mfu

    lines = ["| model | precision (matmul dtype), device | tokens/step | matmul params | train GFLOP/s | "
             "matmul GFLOP/s | fraction | MFU (datasheet bf16 peak) | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kw in st.train_runs:
        r = train_mfu.measure(log=log, **kw)
        fraction = r["fraction"].median
        need = 0.6 if kw["dtype"] == "bfloat16" else 0.5  # round 4's bf16 target; round 3's fp32 one
        h.add(f"train {r['model']} {r['dtype']}: fraction of matmul FLOP/s", fraction, True)
        mfu = "n/a (CPU)" if r["mfu"] is None else f"{fmt(r['mfu'], 100, 1)}%"
        lines.append(f"| {r['model']} | {r['dtype']} ({r['compute_dtype']}), {r['device']} | {r['tokens']} "
                     f"({r['rows']} rows, micro {r['micro']}) | {r['matmul_params'] / 1e6:.1f}M | "
                     f"{fmt(r['achieved'], 1e-9)} | "
                     f"{fmt(r['limit'], 1e-9)} | **{fmt(r['fraction'], 100, 0)}%** | {mfu} | "
                     f"{verdict(fraction >= need, f'>= {need:.0%}')} |")
        lines.append(f"| | `python bench/train_mfu.py --model {kw['model_name']} --dtype {kw['dtype']} --rows "
                     f"{kw['rows']} --prompt-len {kw['prompt_len']} --response-len {kw['response_len']} --micro "
                     f"{kw['micro']} --reps {kw['reps']} --mm-size {kw['mm_size']}` | | | | | | | |")
    return lines


def section_memory(st: Settings, log, h: Headlines) -> list[str]:
    lines = ["| model | precision | rows x (prompt + response), micro-batch | weights + AdamW (resident after a step) "
             "MiB | activations and gradients of a step MiB | process peak MiB | step s | vs round 1's peak | "
             "verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kw in st.memory_runs:
        argv = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
        # a fresh process each (but at smoke size, whose numbers are not read): its peak resident set is this run's
        # alone; large tensors mapped and unmapped on their own, so that the resident set tracks live memory rather
        # than what glibc's arenas keep (as round 1's peak)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
        r = run_script("train_memory", argv, fresh=st.fresh_processes, env=env)
        name = f"{r['model']} {r['dtype']}{' gradient checkpointing' if r['gradient_checkpointing'] else ''}"
        log(f"  [memory {name}] peak {r['peak_total_mib']:.0f} MiB, "
            f"step {r['time_s']['median']} s")
        peak, base = r["peak_total_mib"], None
        if r["model"] == "smollm2_135m" and r["memory"] == "process resident":  # round 1 measured the CPU process
            base = ROUND1_PEAK_MIB.get(r["dtype"])
        h.add(f"memory {name}: actor peak MiB", peak, False)
        vs_round1 = "n/a (not measured in round 1)" if base is None else f"{peak / base:.0%} of {base:.0f} MiB"
        ckpt = ", gradient checkpointing" if r["gradient_checkpointing"] else ""
        lines.append(f"| {r['model']} | {r['dtype']} ({r['compute_dtype']}){ckpt}, {r['memory']} | {r['rows']} x "
                     f"({r['prompt_len']} + {r['response_len']}), {r['micro']} | {r['rss_base_mib']:.0f} | "
                     f"{r['activation_mib']['median']:.0f} ({r['activation_mib']['min']:.0f}-"
                     f"{max(r['activation_mib']['values']):.0f}) | **{r['peak_total_mib']:.0f}** | "
                     f"{r['time_s']['median']:.2f} ({r['time_s']['min']:.2f}-{max(r['time_s']['values']):.2f}) | "
                     f"{vs_round1} | {verdict(None if base is None else peak <= 0.4 * base, '<= 40% of round 1')} |")
        lines.append(f"| | `MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} python bench/train_memory.py {' '.join(argv)}` "
                     "| | | | | | | |")
    return lines


def section_growth(st: Settings, log, h: Headlines) -> list[str]:
    def cell(p: dict, side: str, key: str, digits: int) -> str:
        v = p[side][key]
        return f"{v['median']:.{digits}f}" + (f" ({v['min']:.{digits}f}-{max(v['values']):.{digits}f})"
                                              if len(v["values"]) > 1 else "")

    lines = []
    for kw in st.growth_runs:
        argv = []
        for k, v in kw.items():
            argv += [f"--{k.replace('_', '-')}", *map(str, v if isinstance(v, list) else [v])]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}  # freed tensors leave the resident set
        r = run_script("cost_growth", argv, fresh=st.fresh_processes, env=env)
        name = f"{r['model']} {r['dtype']}"
        lines += [f"{name}, micro-batches of at most {r['budget']} tokens, responses spread {r['spread']}x "
                  f"(L/{r['spread']}..L), prompts of {r['prompt_len']} tokens; limit: the real tokens' training "
                  f"FLOPs at {r['peak_flops'] / 1e9:.0f} GFLOP/s ({r['matmul_params'] / 1e6:.1f}M matmul params); "
                  "step s and activation MiB as median (min-max).", "",
                  "| curve | L | rows | real / padded tokens | limit s | padded step s | packed step s | padded / limit"
                  " | packed / limit | padded activation MiB | packed activation MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for curve in ("length", "group"):
            for p in r[curve]:
                label = f"length (~{r['tokens']} tokens)" if curve == "length" else f"group G={p['G']}"
                pad, pack = p["pad"]["time_s"]["median"], p["pack"]["time_s"]["median"]
                lines.append(f"| {label} | {p['L']} | {p['rows']} | {p['tokens']} / {p['padded_tokens']} | "
                             f"{p['limit_s']:.3g} | {cell(p, 'pad', 'time_s', 2)} | {cell(p, 'pack', 'time_s', 2)} | "
                             f"{pad / p['limit_s']:.2f}x | **{pack / p['limit_s']:.2f}x** | "
                             f"{cell(p, 'pad', 'activation_mib', 0)} | {cell(p, 'pack', 'activation_mib', 0)} |")
        first, last = r["length"][0], r["length"][-1]
        growth = last["L"] / first["L"]
        grew = {side: last[side]["activation_mib"]["median"] / max(first[side]["activation_mib"]["median"], 1.0)
                for side in ("pad", "pack")}
        for side, g in grew.items():
            h.add(f"growth {name} {side}: activation at L={last['L']} / L={first['L']}", g, False)
        h.add(f"growth {name}: packed step / limit at L={last['L']}",
              last["pack"]["time_s"]["median"] / last["limit_s"], False)
        speedup = last["pad"]["time_s"]["median"] / last["pack"]["time_s"]["median"]
        ok = all(g <= growth for g in grew.values())
        lines += ["", f"From L={first['L']} to L={last['L']} ({growth:.0f}x) the activation memory of a step grows "
                  f"{grew['pad']:.2f}x padded and {grew['pack']:.2f}x packed; packing takes a step at L={last['L']} "
                  f"{speedup:.2f}x faster than padding. Verdict: "
                  f"{verdict(ok, 'memory growing no faster than the response length')}.",
                  f"`MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} python bench/cost_growth.py {' '.join(argv)}`", ""]
        log(f"  [growth {name}] packed vs padded at L={last['L']}: {speedup:.2f}x")
    return lines


def section_overhead(st: Settings, log, h: Headlines) -> list[str]:
    import torch

    from bench import overhead

    lines = ["| run (Ray loop, `relax.runner.train.run`) | step s | samples/s | engine s | actor train_step s | "
             "overhead s | overhead share | start-up to step 0 s | after the last step s | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    profiles: list[str] = []
    for overrides, steps, *ray_running in st.overhead_runs:
        running = bool(ray_running and ray_running[0])
        r = overhead.measure(overrides, steps, log=log, ray_running=running)
        where = "Ray already running" if running else "the run starts Ray"
        model = overrides[0].split("=")[1]
        if torch.cuda.is_available():  # the roles on the GPU (a local cluster keeps them off it)
            overrides = [*overrides, "cluster=1xgpu"]
        share, start_cap = (0.05, 15.0) if model == "smollm2_135m" else (0.10, 8.0)
        name = f"overhead {model}{' (Ray running)' if running else ''}"
        h.add(f"{name}: overhead share", r["fraction"].median, False)
        h.add(f"{name}: start-up s", r["startup_s"], False)
        ok = r["fraction"].median <= share and r["startup_s"] <= start_cap
        lines.append(f"| `{' '.join(overrides)}` ({steps} steps, first dropped; {where}) | {fmt(r['step'], 1, 2)} | "
                     f"{fmt(r['samples_per_s'], 1, 1)} | {r['engine_s']:.2f} | {r['compute_s']:.2f} | "
                     f"{r['overhead_s']:.3f} | **{fmt(r['fraction'], 100, 1)}%** | **{r['startup_s']:.1f}** | "
                     f"{r['shutdown_s']:.1f} | {verdict(ok, f'<= {share:.0%} and start-up <= {start_cap:g} s')} |")
        lines.append(f"| `python bench/overhead.py --model {model} --steps {steps} "
                     f"{'--ray-running ' if running else ''}{' '.join(overrides[1:])}` | | | | | | | | | |")
        profiles.append(f"- {model}, {where}: start-up {overhead.describe(r['startup_parts'], 1)}; a step's "
                        f"overhead {overhead.describe(r['overhead_parts'], 1000)}")
    return [*lines, "", "Where it goes (bench/overhead.py's profile of the same runs: start-up by phase, the median "
            "step's overhead by part):", "", *profiles]


def section_modes(st: Settings, log, h: Headlines) -> list[str]:
    from bench import async_modes

    lines = ["| work (Ray loop) | mode | samples/s | vs sync | train idle | rollout idle | sync phases (s): rollout / "
             "train | verdict |", "|---|---|---|---|---|---|---|---|"]
    for work, steps, reps, modes in st.modes_runs:
        r = async_modes.compare(work, steps, reps, warmup=1 if steps <= 3 else 2, log=log, modes=modes)
        phases = f"{r['sync']['rollout_s'].median:.2f} / {r['sync']['train_s'].median:.2f}"
        disjoint = any(o.startswith("+cluster.role_cores=") for o in work)
        for mode in modes:
            m, speedup = r[mode], r["speedup"][mode].median
            h.add(f"modes {'disjoint cores ' if disjoint else ''}{mode}: samples/s vs sync", speedup, True)
            # round 4: overlap can pay only where the phases do not share cores; on shared cores it is measured
            need = {"fully_async": 1.8, "hybrid": 1.5}.get(mode) if disjoint else None
            target = verdict(None) if need is None else verdict(speedup >= need, f">= {need}x sync")
            lines.append(f"| `{' '.join(work)}` | {mode} ({' '.join(async_modes.MODES[mode])}) | "
                         f"{fmt(m['samples_per_s'], 1, 1)} | **{fmt(r['speedup'][mode], 1, 2)}** | "
                         f"{m['train_idle'].median:.0%} | {m['rollout_idle'].median:.0%} | {phases} | {target} |")
        flags = f"--steps {steps} --reps {reps}" + (" --disjoint-cores --modes " + ",".join(modes) if disjoint else "")
        shown = " ".join(o for o in work if not o.startswith("+cluster.role_cores="))
        lines.append(f"| `python bench/async_modes.py {flags} {shown}` | | | | | | | |")
    return lines


def section_sglang(st: Settings, log, h: Headlines) -> list[str]:
    from bench import sglang_requests

    lines = ["| model | prompts x group x new tokens | in-process engine tok/s | per sample (HTTP) tok/s | per prompt, "
             "n=group (HTTP) tok/s | per sample / in-process | per sample / per prompt |",
             "|---|---|---|---|---|---|---|"]
    for overrides, kw in st.sglang_runs:
        r = sglang_requests.compare(overrides, threads=2, log=log, **kw)
        h.add(f"sglang {overrides[0]}: per sample / per prompt tok/s", r["per_sample_vs_per_prompt"].median, True)
        lines.append(f"| `{' '.join(overrides)}` | {kw['prompts']} x {kw['group']} x {kw['new_tokens']} | "
                     f"{fmt(r['in_process'], 1, 0)} | {fmt(r['per_sample'], 1, 0)} | {fmt(r['per_prompt'], 1, 0)} | "
                     f"{fmt(r['per_sample_vs_in_process'], 1, 2)} | **{fmt(r['per_sample_vs_per_prompt'], 1, 2)}** |")
        lines.append(f"| `python bench/sglang_requests.py --prompts {kw['prompts']} --group {kw['group']} --new-tokens "
                     f"{kw['new_tokens']} --reps {kw['reps']} {' '.join(overrides)}` | | | | | | |")
    return lines


def section_agents(st: Settings, log, h: Headlines) -> list[str]:
    from bench import agent_episodes

    lines = ["| model | episodes (prompts x group), turns of <= tokens | turns/episode | identical episodes | "
             "in-engine episodes/s | a turn per call episodes/s | speedup | context tokens not recomputed / episode "
             "tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for kw in st.agent_runs:
        r = agent_episodes.compare(threads=2, log=log, **kw)
        h.add(f"agents {kw['model']}: in-engine / turn per call episodes/s", r["speedup"].median, True)
        lines.append(f"| {kw['model']} (fp32) | {r['episodes']} ({kw['prompts']} x {kw['group']}), {kw['turns']} of <= "
                     f"{kw['turn_len']} | {r['turns_mean']:.2f} | {r['same']} / {r['episodes']} | "
                     f"{fmt(r['in_engine'], 1, 1)} | "
                     f"{fmt(r['turn_per_call'], 1, 1)} | **{fmt(r['speedup'], 1, 2)}** | {r['reused']} / "
                     f"{r['tokens']} |")
        lines.append(f"| | `python bench/agent_episodes.py --model {kw['model']} --prompts {kw['prompts']} --group "
                     f"{kw['group']} --turns {kw['turns']} --turn-len {kw['turn_len']} --reps {kw['reps']}` "
                     "| | | | | | |")
    return lines


def section_math(st: Settings, log, h: Headlines) -> list[str]:
    from bench import algorithm_math

    args = algorithm_math.parser().parse_args(["--tokens", str(st.math_tokens), "--reps", str(st.math_reps)])
    res = algorithm_math.run(args, log=log)
    prefix = "compute_loss fwd+bwd "
    cheapest = min(v for k, v in res.items() if k.startswith(prefix))
    lines = ["| what | median ms | vs the cheapest loss | verdict |", "|---|---|---|---|"]
    for k, v in res.items():
        h.add(f"math {k}: ms", v * 1e3, False)
        if k == "m2po_clip_bounds":
            cells = f"**{v * 1e3:.2f}** | | {verdict(v < 0.025, '< 25 ms')}"
        elif k.startswith(prefix):
            cells = f"{v * 1e3:.2f} | {v / cheapest:.2f}x | {verdict(v <= 1.5 * cheapest, '<= 1.5x the cheapest')}"
        else:  # the solve and the loss together: no target of its own
            cells = f"{v * 1e3:.2f} | | {verdict(None)}"
        lines.append(f"| {k} | {cells} |")
    lines.append(f"\n`python bench/algorithm_math.py --tokens {st.math_tokens} --reps {st.math_reps}`")
    return lines


def section_lora(st: Settings, log, h: Headlines) -> list[str]:
    from bench import lora

    lines = ["| model, rank | side | actor peak MiB (train step s) | with gradient checkpointing | update bytes | "
             "update s | samples/s (Ray loop) | verdict |", "|---|---|---|---|---|---|---|---|"]

    def cell(m: dict) -> str:
        t = m["time_s"]
        return f"{m['peak_total_mib']:.0f} ({t['median']:.2f}, {t['min']:.2f}-{max(t['values']):.2f})"

    for kw in st.lora_runs:
        r = lora.compare(**kw, fresh_processes=st.fresh_processes)
        mem, sync, e2e = r["memory"], r["sync"], r["end_to_end"] or {}
        sides = ("", " checkpointing") if "full checkpointing" in mem else ("",)  # smoke: without checkpointing
        ratios = [mem[f"lora{c}"]["peak_total_mib"] / mem[f"full{c}"]["peak_total_mib"] for c in sides]
        smaller = sync["full"]["bytes"] / sync["lora adapter"]["bytes"]
        name = f"lora {r['model']} rank {r['rank']}"
        h.add(f"{name}: peak vs full", ratios[0], False)
        if len(ratios) > 1:
            h.add(f"{name}: peak vs full, checkpointing", ratios[1], False)
        h.add(f"{name}: adapter update smaller", smaller, True)
        target = r["model"] == "smollm2_135m"
        rows = [("full fine-tuning", "full", sync["full"], e2e.get("full"), ""),
                ("LoRA, merged update", "lora", sync["lora merged"], e2e.get("lora"),
                 verdict(min(ratios) <= 0.5 if target else None, "peak <= 50% of full")),
                ("LoRA, adapter update", None, sync["lora adapter"], None,
                 verdict(smaller >= 20 if target else None, ">= 20x smaller update"))]
        for side, key, s_, e, ok in rows:
            peaks = ("", "") if key is None else (cell(mem[key]), cell(mem[f"{key} checkpointing"])
                                                  if f"{key} checkpointing" in mem else "not measured")
            sps = "" if e is None else f"{e['samples_per_s']:.2f}"
            lines.append(f"| {r['model']}, {r['rank']} | {side} | {peaks[0]} | {peaks[1]} | {s_['bytes']:,} | "
                         f"{s_['median_s']:.4f} | {sps} | {ok} |")
        with_ckpt = f" ({ratios[1]:.0%} with gradient checkpointing on both)" if len(ratios) > 1 else ""
        lines.append(f"| | `python bench/lora.py --model {r['model']} --rank {r['rank']}`: peak {ratios[0]:.0%} of "
                     f"full{with_ckpt}; adapter update {smaller:.1f}x smaller | | | | | | |")
    return lines


RUNNERS = {"rl": section_rl, "rollout": section_rollout, "train": section_train, "memory": section_memory,
           "growth": section_growth, "overhead": section_overhead,
           "modes": section_modes, "sglang": section_sglang, "agents": section_agents, "math": section_math,
           "lora": section_lora}
TITLES = {
    "rl": "RL step throughput: Relax GRPO vs TRL GRPOTrainer (in-process, same work)",
    "rollout": "Rollout engine vs Hugging Face `generate`",
    "train": "Train phase vs the machine's matmul limit",
    "memory": "Actor memory: one train step of the real trainer",
    "growth": "Cost as work grows: response length and group size, padded and packed",
    "overhead": "Overhead of the real Ray loop",
    "modes": "Training modes: sync vs hybrid vs fully_async (Ray loop, same work)",
    "sglang": "rollout=sglang requests: per sample vs per prompt, through the router to relax-serve",
    "agents": "Agentic episodes: the KV cache kept across turns vs a turn per call",
    "math": "Algorithm math",
    "lora": "LoRA vs full fine-tuning: memory, weight updates, the loop",
}


def render(rep: Report, notes: str) -> str:
    out = ["# Relax performance", "",
           f"Generated by `{rep.command}` (mode: {rep.mode}). Regenerate with `python -m bench` "
           "(`--quick` for a shorter run). Numbers are medians with (min-max, n) over alternating repetitions.", "",
           "## Machine", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rep.machine.items()]
    if rep.machine.get("gpu", "none") == "none":
        out += ["", "GPU: none in this run, so no GPU numbers. On a machine with one, `bash bench/gpu.sh` runs the "
                "rollout, train, memory, overhead and math sections on it (the trainer, the engine, the Ray loop with "
                "`cluster=1xgpu`), MFU against the datasheet bf16 peak, into docs/performance_gpu.md. On a bare lent "
                "machine (no Ray), `bash tests/gpu/bare.sh --bench OUT.md` runs the same sections but the Ray "
                "loop's (tests/gpu/README.md)."]
    else:
        ray_loop = " and the Ray loop (`cluster=1xgpu`)" if "overhead" in rep.sections else ""
        out += ["", f"GPU: {rep.machine['gpu']}. The trainer{',' if ray_loop else ' and'} the rollout engine{ray_loop} "
                "ran on it; TRL's comparison is a CPU benchmark and is skipped."]
    out += ["", "## Targets", ""]
    out += [f"- **{TITLES[k].split(':')[0]}**: {v}" for k, v in TARGETS.items()]
    for name in SECTIONS:
        if name not in rep.sections and name not in rep.errors:
            continue
        out += ["", f"## {TITLES[name]}", ""]
        if name in rep.loads:
            out += [f"Load average before / after: {rep.loads[name][0]} ; {rep.loads[name][1]}", ""]
        if name in rep.errors:
            out += ["```", rep.errors[name].strip(), "```"]
        else:
            out += rep.sections[name]
    out += ["", "## Against the previous report", "", *comparison(rep.before, rep.headlines)]
    if notes:
        out += ["", notes.strip()]
    out += ["", rep.headlines.embed()]
    return "\n".join(out) + "\n"


# the sections that never start Ray (what a bare GPU machine without Ray runs: tests/gpu/bare.sh)
WITHOUT_RAY = ("rollout", "train", "memory", "growth", "math")


def _ray_running() -> bool:
    import ray

    return ray.is_initialized()


def run_sections(rep: Report, only: list[str], st: Settings, log) -> None:
    """Each section of `only` in turn into `rep` (a failing one is recorded, the others still run)."""
    for name in only:
        before = load_average()
        log(f"== {name} (load {before})")
        t0 = time.perf_counter()
        try:
            rep.sections[name] = RUNNERS[name](st, log, rep.headlines)
        except Exception:  # one broken section must not lose the others
            rep.errors[name] = traceback.format_exc()
            log(rep.errors[name])
        rep.loads[name] = (before, load_average())
        log(f"   {name}: {time.perf_counter() - t0:.0f}s")
    rep.machine["load average (1/5/15 min) at end"] = load_average()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--out", default=None, help="report path (default docs/performance.md; smoke: required)")
    ap.add_argument("--notes", default=str(Path(__file__).with_name("notes.md")),
                    help="markdown appended to the report (analysis, profiles)")
    a = ap.parse_args(argv)
    m = "smoke" if a.smoke else "quick" if a.quick else "full"
    if m == "smoke" and a.out is None:
        ap.error("--smoke needs --out (it must not overwrite docs/performance.md)")
    out = Path(a.out or Path(__file__).resolve().parents[1] / "docs" / "performance.md")
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    if bad := [s for s in only if s not in SECTIONS]:
        ap.error(f"--only: unknown section(s) {bad}; expected some of {SECTIONS}")
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if torch.cuda.is_available() and "rl" in only:
        only.remove("rl")  # TRL's comparison is a CPU benchmark here
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    cmd = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    rep = Report(mode=m, machine=machine_info(), command=cmd.strip())
    st, dropped = without_slow_bf16(settings(m))
    if dropped:
        rep.machine["bf16 rows"] = ("not measured: this CPU has no native bf16 matmul (AVX512-BF16/AMX), bf16 is "
                                    "emulated at a small fraction of fp32's speed")
    if not st.fresh_processes:
        rep.machine["actor, growth and LoRA memory"] = "measured in the suite's own process (smoke): its resident set"

    def log(msg: str) -> None:
        print(msg, flush=True)

    t_all = time.perf_counter()
    shared_ray = m == "smoke" and any(s not in WITHOUT_RAY for s in only) and not _ray_running()
    if shared_ray:  # the smoke suite checks the report, not start-up: its Ray runs share one instance
        import ray

        from relax.runner.plan import LOCAL_RAY_SYSTEM_CONFIG

        ray.init(include_dashboard=False, logging_level="WARNING", num_cpus=2, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    try:
        run_sections(rep, only, st, log)
    finally:
        if shared_ray:
            ray.shutdown()
    rep.machine["suite wall time"] = f"{time.perf_counter() - t_all:.0f} s"
    notes = Path(a.notes).read_text() if a.notes and Path(a.notes).is_file() and m != "smoke" else ""
    rep.before = previous(out.read_text()) if out.is_file() else None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(rep, notes))
    log(f"report: {out}")
    if rep.errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
