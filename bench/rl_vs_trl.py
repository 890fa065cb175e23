"""RL step throughput: Relax GRPO against TRL's GRPOTrainer on the same model, prompts and settings.

Both sides start from the same weights (TRL trains a deep copy of the Relax policy's initial model),
sample the same number of prompts x group size, generate exactly `--completion-len` tokens per sample
(EOS disabled on both sides, so the work is identical), take ONE AdamW step per generation batch over
micro-batches of the same size, at the same precision (fp32, or bf16 autocast for the forward/backward
with bf16 generation). Relax runs its roles' classes in this process (no Ray); TRL runs with
`use_vllm=False`, no logging, no evaluation, no saving. Steps alternate between the sides in blocks.

With `--variable` both sides stop at EOS (up to `--completion-len` tokens), as RL responses do, and the rate is
tokens/s (response tokens per second of step: the two sides sample differently, so their batches differ in
length); the report gives the spread of response lengths (shortest and longest of the measured steps, each side).

    python bench/rl_vs_trl.py --model tiny --dtype float32
    python bench/rl_vs_trl.py --model smollm2_135m --dtype bfloat16 --prompts 4 --group 4 --completion-len 32
    python bench/rl_vs_trl.py --model smollm2_135m --dtype float32 --prompts 4 --group 4 --completion-len 64 --variable
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import tempfile
import time

import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Series, ratio_series
from bench.limits import MM_SIZE

MODEL_OVERRIDES = {"tiny": ["model=tiny"], "smollm2_135m": ["model=smollm2_135m"]}


def relax_overrides(model: str, dtype: str, prompts: int, group: int, completion_len: int, micro: int) -> list[str]:
    return [*MODEL_OVERRIDES[model], "data=arithmetic", f"model.dtype={dtype}",
            f"rollout.rollout_batch_size={prompts}", f"rollout.n_samples_per_prompt={group}",
            f"rollout.max_response_len={completion_len}", f"train.micro_batch_size={micro}",
            "tracking.enabled=false", "train.save=false"]


class RelaxInProcess:
    """The body of `relax.runner.train.run` (rollout -> rewards -> advantages -> train -> sync) without Ray."""

    def __init__(self, overrides: list[str], fixed_length: bool = True):
        from relax.algorithms.base import AdvantageInputs  # noqa: F401  (import cost outside the timing)
        from relax.config.compose import load_config
        from relax.roles.workers import PolicyWorker, RolloutWorker
        from relax.runner import train
        from relax.train.trainer import available_cpus

        self.cfg = load_config(overrides)
        inputs = train.prepare(self.cfg)
        self.tokenizer, self.sampler, self.reward_fn, info = (inputs.tokenizer, inputs.sampler, inputs.reward_fn,
                                                              inputs.info)
        if fixed_length:
            info = dataclasses.replace(info, eos_token_ids=())
        threads = available_cpus()
        self.policy = PolicyWorker(self.cfg, info, threads=threads)
        self.rollout = RolloutWorker(self.cfg, info, threads=threads)
        self.rollout.load_weights(self.policy.weights(), 0)
        self.n_step = 0
        self.phases: dict[str, list[float]] = {"rollout": [], "reward+adv": [], "train": [], "sync": []}

    def step(self) -> float:
        from relax.algorithms.base import AdvantageInputs
        from relax.batch import TrainBatch
        from relax.roles.workers import compute_advantages
        from relax.runner.rollout_driver.scoring import score

        cfg, G = self.cfg, self.cfg.rollout.n_samples_per_prompt
        t0 = time.perf_counter()
        items = self.sampler.next_batch()
        samples = self.rollout.generate([it.prompt_ids for it in items], seed=1000 + self.n_step)
        t1 = time.perf_counter()
        rewards = torch.tensor(score(cfg, self.tokenizer, self.reward_fn, samples, items, G).rewards)
        mask = samples.response_mask.float()
        out = compute_advantages(cfg.algorithm, AdvantageInputs(rewards, mask, G, samples.rollout_logp, None, None))
        batch = TrainBatch.from_samples(samples, rewards=rewards, advantages=out.advantages)
        t2 = time.perf_counter()
        self.policy.train_step(batch)
        t3 = time.perf_counter()
        self.rollout.load_weights(self.policy.weights(), self.n_step + 1)
        t4 = time.perf_counter()
        for k, v in zip(self.phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            self.phases[k].append(v)
        self.n_step += 1
        self.last_lengths = samples.response_mask.sum(-1).tolist()
        self.last_tokens = int(samples.response_mask.sum())
        self.last_prompt_tokens = int(samples.prompt_mask.sum())
        return t4 - t0

    def limit_s(self, completion_len: float, mm_size: int) -> dict[str, float]:
        """The last step's time at this machine's limits (`bench.limits`, its matmuls of `mm_size`), in the rollout
        engine's dtype."""
        from bench.limits import Machine, step_limit_s
        from bench.train_mfu import matmul_params

        model = self.policy.policy.model
        engine = self.rollout.engine.model
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.parameters())
        compute = next(engine.parameters()).dtype  # bf16 runs bf16 matmuls on both sides (autocast in training)
        rows = self.cfg.rollout.rollout_batch_size * self.cfg.rollout.n_samples_per_prompt
        return step_limit_s(Machine.measure(compute, mm_size), matmul_params=matmul_params(model),
                            weight_bytes=weight_bytes, rows=rows, prompt_tokens=self.last_prompt_tokens,
                            response_len=completion_len)


def _plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` without the GGUF loader's quantization marker (the weights are plain fp32 tensors)."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        fresh = type(model)(config)
    fresh = fresh.to_empty(device="cpu").to(torch.float32)
    fresh.load_state_dict(model.state_dict())
    fresh.tie_weights()
    for (_, buf), (_, src) in zip(fresh.named_buffers(), model.named_buffers(), strict=True):
        buf.copy_(src)  # rotary inv_freq: non-persistent buffers
    return fresh


class TRLRunner:
    """TRL's GRPOTrainer on a copy of the same initial model; `block(k)` trains k steps, returns step times."""

    def __init__(self, relax: RelaxInProcess, dtype: str, prompts: int, group: int, completion_len: int, micro: int,
                 variable: bool = False):
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        cfg = relax.cfg
        model = _plain_copy(relax.policy.policy.model)  # fp32 master weights, like the policy
        model.config.use_cache = True
        model.generation_config.use_cache = True
        reward_fn = relax.reward_fn

        self.lengths: list[int] = []  # response tokens of every completion generated, in order
        lengths = self.lengths

        def reward(prompts, completions, label, completion_ids=None, **kwargs):  # noqa: ARG001
            lengths.extend(len(ids) for ids in completion_ids or [])
            return [float(reward_fn(c, lab)) for c, lab in zip(completions, label, strict=True)]

        items = [relax.sampler.dataset[i] for i in range(min(len(relax.sampler.dataset), 512))]
        data = Dataset.from_list([{"prompt": it.prompt_text, "label": it.label} for it in items])
        n = prompts * group
        self.times: list[float] = []
        self.tokens: list[int] = []  # response tokens of each step
        times, tokens = self.times, self.tokens

        class StepTimes(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                self.t0, self.seen = time.perf_counter(), len(lengths)

            def on_step_end(self, args, state, control, **kw):
                times.append(time.perf_counter() - self.t0)
                tokens.append(sum(lengths[self.seen:]))

        self.tmp = tempfile.TemporaryDirectory()
        args = GRPOConfig(
            output_dir=self.tmp.name, per_device_train_batch_size=micro, gradient_accumulation_steps=max(1, n // micro),
            num_generations=group, max_completion_length=completion_len, num_iterations=1, beta=0.0,
            learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            adam_beta1=cfg.train.adam_beta1, adam_beta2=cfg.train.adam_beta2, max_grad_norm=cfg.train.clip_grad,
            optim="adamw_torch_fused",  # TRL's default, and the AdamW Relax runs
            temperature=cfg.rollout.temperature, top_p=1.0, top_k=0, loss_type="grpo",
            scale_rewards="group", bf16=dtype == "bfloat16", fp16=False, use_cpu=True, use_vllm=False,
            # EOS off: exactly completion_len tokens (`variable`: up to completion_len, stopping at EOS)
            generation_kwargs={} if variable else {"min_new_tokens": completion_len},
            report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
            gradient_checkpointing=False,  # TRL turns it on by default; Relax trains without it
            log_completions=False, dataloader_num_workers=0, seed=cfg.seed, max_steps=1, shuffle_dataset=True,
        )  # fmt: skip
        self.trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                                   processing_class=relax.tokenizer, callbacks=[StepTimes()])
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        for cb in (PrinterCallback, ProgressCallback):  # no console logging on the TRL side
            self.trainer.remove_callback(cb)

    def block(self, steps: int) -> list[float]:
        start = len(self.times)
        self.trainer.args.max_steps = steps
        self.trainer.train()
        return self.times[start:]


def compare(model: str, dtype: str, *, prompts: int, group: int, completion_len: int, micro: int, blocks: int,
            steps_per_block: int, variable: bool = False, mm_size: int = MM_SIZE, log=print) -> dict:
    """Alternating blocks of `steps_per_block` steps per side; the first step of each block is a warm-up. The rate is
    samples/s, or response tokens/s with `variable` (responses stop at EOS). `mm_size`: of the matmuls that
    measure the machine's limit (`bench.limits.Machine`)."""
    torch.manual_seed(0)
    relax = RelaxInProcess(relax_overrides(model, dtype, prompts, group, completion_len, micro),
                           fixed_length=not variable)
    trl = TRLRunner(relax, dtype, prompts, group, completion_len, micro, variable=variable)
    n = prompts * group
    unit = "tokens/s" if variable else "samples/s"
    per_side: dict[str, Series] = {"relax": Series(), "trl": Series()}
    lengths: dict[str, list[int]] = {"relax": [], "trl": []}
    relax_tokens: list[int] = []  # response tokens of Relax's measured steps
    relax.step()  # warm-up (oneDNN kernels, allocator)
    for b in range(blocks):
        order = ["relax", "trl"] if b % 2 == 0 else ["trl", "relax"]
        for side in order:
            if side == "relax":
                times, tokens = [], []
                for _ in range(steps_per_block):
                    times.append(relax.step())
                    tokens.append(relax.last_tokens)
                    lengths["relax"] += relax.last_lengths
            else:
                first = len(trl.lengths)
                times = trl.block(steps_per_block)
                tokens = trl.tokens[-len(times):]
                lengths["trl"] += trl.lengths[first:]
            keep = slice(1, None) if len(times) > 1 else slice(None)
            if side == "relax":
                relax_tokens += tokens[keep]
            rate = sum(tokens[keep]) / sum(times[keep]) if variable else n / (sum(times[keep]) / len(times[keep]))
            per_side[side].values.append(rate)
            log(f"  [{model} {dtype}] block {b} {side}: {rate:.2f} {unit} "
                f"(step times {', '.join(f'{t:.2f}' for t in times)} s)")
    phases = {k: sum(v[1:]) / max(1, len(v) - 1) for k, v in relax.phases.items()}
    # the limit of a step at its mean response length (variable) or exactly completion_len tokens
    mean_len = sum(relax_tokens) / len(relax_tokens) / n if variable and relax_tokens else completion_len
    limit = relax.limit_s(mean_len, mm_size)
    log(f"  [{model} {dtype}] limit of a step: {limit}")
    step_s = [sum(relax_tokens) / len(relax_tokens) / v if variable else n / v for v in per_side["relax"].values]
    return {
        "model": model, "dtype": dtype, "samples_per_step": n, "completion_len": completion_len, "micro": micro,
        "variable": variable, "unit": unit,
        "lengths": {k: (min(v), max(v)) if v else (0, 0) for k, v in lengths.items()},
        "relax": per_side["relax"], "trl": per_side["trl"], "ratio": ratio_series(per_side["relax"], per_side["trl"]),
        "relax_phases_s": phases, "limit_s": limit,
        "vs_limit": Series([t / limit["total"] for t in step_s]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=list(MODEL_OVERRIDES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--completion-len", type=int, default=8)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps-per-block", type=int, default=3)
    ap.add_argument("--variable", action="store_true", help="responses stop at EOS; the rate is tokens/s")
    ap.add_argument("--mm-size", type=int, default=MM_SIZE,
                    help="square matmuls that measure the machine's limit (smaller: the caches, for smoke runs)")
    a = ap.parse_args()
    r = compare(a.model, a.dtype, prompts=a.prompts, group=a.group, completion_len=a.completion_len, micro=a.micro,
                blocks=a.blocks, steps_per_block=a.steps_per_block, variable=a.variable, mm_size=a.mm_size)
    print(f"relax {r['relax'].median:.2f} {r['unit']} ({r['relax'].spread}); trl {r['trl'].median:.2f} "
          f"({r['trl'].spread}); ratio {r['ratio'].median:.2f}x ({r['ratio'].spread}); "
          f"relax phases {r['relax_phases_s']}; step / limit {r['vs_limit'].median:.2f}x; response lengths "
          f"{r['lengths']}")


if __name__ == "__main__":
    main()
