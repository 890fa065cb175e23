"""The synchronous training recipe, top to bottom: rollout -> rewards -> advantages -> train -> sync.

Everything that can fail because of user input (model path, data, reward function) is checked
before Ray starts. Roles are Ray actors created from the plan; the loop below only calls their
methods and moves `Samples` / `TrainBatch` between them.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from relax import algorithms
from relax.algorithms.base import AdvantageInputs
from relax.backends.batch import Samples, TrainBatch
from relax.config.schema import RelaxConfig
from relax.metrics import (
    ACTOR_COMPUTE_TIME,
    OVERHEAD_FRACTION,
    OVERHEAD_TIME,
    ROLLOUT_ENGINE_TIME,
    ROLLOUT_TIME,
    STEP_TIME,
    SYNC_TIME,
    TOKENS_PER_S,
    TRAIN_TIME,
)
from relax.runner import checkpoint
from relax.runner.cluster import Cluster
from relax.runner.errors import RunError
from relax.runner.metrics import eval_metrics, rollout_metrics
from relax.runner.plan import Plan
from relax.runner.session import RunResult, Session

# Inside the rollout engine (the generation itself), measured in the engine's process.
# Step time not spent in generation or in the actor's train_step (forward, backward, optimizer): Ray calls,
# moving samples and weights, rewards, advantages, log-prob/value calls of other roles, evaluation.


def _prepare(cfg: RelaxConfig):
    """Tokenizer, datasets and reward function: the user-input failures, before any process starts."""
    from relax.data.datasets import DataError, PromptSampler, build_datasets
    from relax.data.tokenizer import load_tokenizer, resolve_model_path
    from relax.rewards.registry import get_reward_fn
    from relax.roles.workers import ModelInfo

    try:
        if cfg.model.source != "config":
            resolve_model_path(cfg.model)
        tokenizer = load_tokenizer(cfg.model)
        train_set, eval_set = build_datasets(cfg, tokenizer)
        reward_fn = get_reward_fn(cfg.data.reward)
    except (DataError, FileNotFoundError, ValueError, ImportError) as exc:
        raise RunError(str(exc)) from None
    if cfg.train.backend != "torch" or cfg.rollout.backend != "embedded":
        raise RunError(f"train.backend={cfg.train.backend} / rollout.backend={cfg.rollout.backend}: this build runs "
                       "train.backend=torch with rollout=embedded; "
                       "the Megatron and SGLang backends are not available yet")
    eos = tokenizer.eos_token_id
    eos_ids = tuple(sorted({eos} if isinstance(eos, int) else set(eos or [])))
    info = ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_ids=eos_ids)
    sampler = PromptSampler(train_set, cfg.rollout.rollout_batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle)
    return tokenizer, sampler, eval_set, reward_fn, info


def _score(tokenizer, reward_fn, samples: Samples, labels: list[str]) -> tuple[torch.Tensor, int]:
    from relax.rewards.registry import score_responses

    texts = [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
             for ids, mask in zip(samples.response_ids, samples.response_mask, strict=True)]
    rewards, errors = score_responses(reward_fn, texts, labels)
    return torch.tensor(rewards, dtype=torch.float32), errors


def _needs_old_logp(cfg: RelaxConfig) -> bool:
    """Recompute old log-probs unless the batch is exactly on-policy and nothing else reads them."""
    a = cfg.algorithm
    return cfg.train.num_steps_per_rollout > 1 or a.use_tis or a.kl_coef != 0 or cfg.train.mode != "sync"


def run(cfg: RelaxConfig, plan: Plan | None = None, *, output_dir: Path, dictconfig=None) -> RunResult:
    """Train `cfg` to the end (or resume it); returns the logged history and the reward summary."""
    from relax.runner.plan import build_plan

    plan = plan or build_plan(cfg)

    tokenizer, sampler, eval_set, reward_fn, info = _prepare(cfg)
    algo = algorithms.get(cfg.algorithm.name)
    G = cfg.rollout.n_samples_per_prompt
    save_dir = Path(cfg.train.save_dir) if cfg.train.save_dir else output_dir / "checkpoints"

    with Session(cfg, plan, output_dir, dictconfig) as session, Cluster(cfg, plan, info) as cluster:
        start_step = 0
        resume_from = checkpoint.find(cfg.train.resume, save_dir)
        if resume_from is not None:
            state = cluster.load(resume_from)
            sampler.load_state_dict(state["sampler"])
            start_step = state["step"]
            session.note(f"resumed from {resume_from} at step {start_step}")
        cluster.sync_weights(version=start_step)

        for step in range(start_step, cfg.train.num_rollout):
            t0 = time.perf_counter()
            metrics: dict[str, float] = {}
            # 1. rollout
            batch_items = sampler.next_batch()
            prompts = [item.prompt_ids for item in batch_items]
            samples = cluster.generate(prompts, seed=cfg.seed * 100_003 + step)
            t_rollout = time.perf_counter()
            # 2. rewards
            labels = [item.label for item in batch_items for _ in range(G)]
            rewards, errors = _score(tokenizer, reward_fn, samples, labels)
            metrics.update(rollout_metrics(samples, rewards, errors, G, algo.name))
            # 3. log-probs and values the algorithm needs
            mask = samples.response_mask.float()
            old_logp = None
            if cfg.algorithm.use_rollout_logprobs:
                old_logp = samples.rollout_logp
            elif _needs_old_logp(cfg):
                old_logp = cluster.actor_logprobs(samples)
            ref_logp = cluster.reference_logprobs(samples) if plan.has("reference") else None
            values = cluster.values(samples) if plan.has("critic") else None
            # 4. advantages
            adv_old = old_logp if old_logp is not None else samples.rollout_logp
            out = cluster.advantages(cfg.algorithm, AdvantageInputs(rewards, mask, G, adv_old, ref_logp, values))
            metrics.update(out.metrics)
            batch = TrainBatch.from_samples(samples, rewards=rewards, advantages=out.advantages, old_logp=old_logp,
                                            ref_logp=ref_logp, returns=out.returns, old_values=values)
            # 5. optimizer steps over the global batch(es)
            t_train0 = time.perf_counter()
            metrics.update(cluster.train(batch, step))
            t_train = time.perf_counter()
            # 6. weights to the rollout engines
            cluster.sync_weights(version=step + 1)
            t_sync = time.perf_counter()
            if cfg.train.eval_interval and eval_set is not None and (step + 1) % cfg.train.eval_interval == 0:
                metrics.update(_evaluate(cfg, cluster, tokenizer, reward_fn, eval_set))
            n_tokens = float(samples.response_mask.sum())
            step_time = time.perf_counter() - t0
            overhead = step_time - samples.engine_time - metrics.get(ACTOR_COMPUTE_TIME, 0.0)
            metrics.update({
                ROLLOUT_TIME: t_rollout - t0,
                ROLLOUT_ENGINE_TIME: samples.engine_time,
                TRAIN_TIME: t_train - t_train0,
                SYNC_TIME: t_sync - t_train,
                STEP_TIME: step_time,
                OVERHEAD_TIME: overhead,
                OVERHEAD_FRACTION: overhead / max(step_time, 1e-9),
                TOKENS_PER_S: n_tokens / max(step_time, 1e-9),
            })
            session.log(metrics, step)
            last = step + 1 == cfg.train.num_rollout
            interval = cfg.train.save_interval
            if cfg.train.save and (last or (interval and (step + 1) % interval == 0)):
                cluster.save(save_dir, step + 1, {"sampler": sampler.state_dict(), "step": step + 1})
        return session.finish()


def _evaluate(cfg: RelaxConfig, cluster: Cluster, tokenizer, reward_fn, eval_set) -> dict[str, float]:
    prompts = [item.prompt_ids for item in eval_set]
    samples = cluster.generate(prompts, seed=cfg.seed, evaluation=True)
    n = cfg.rollout.eval_n_samples_per_prompt
    labels = [item.label for item in eval_set for _ in range(n)]
    rewards, errors = _score(tokenizer, reward_fn, samples, labels)
    return eval_metrics(samples, rewards, errors)
