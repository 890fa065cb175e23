"""The role classes. Plain Python, so tests can use them directly; the runner wraps each in `ray.remote`.

Every worker builds its own model from the config (same seed, same initial weights everywhere) and
speaks only `Samples` / `TrainBatch` and state dicts, never a backend's types.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from relax import algorithms
from relax.algorithms.base import AdvantageInputs, AdvantageOutput
from relax.backends.batch import Samples, TrainBatch
from relax.config.schema import RelaxConfig
from relax.metrics import ACTOR_COMPUTE_TIME


@dataclass(frozen=True)
class ModelInfo:
    """What workers need from the tokenizer (the driver loads it once)."""

    vocab_size: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]


def _threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class ReferenceWorker:
    """The reference policy: a frozen model that only computes log-probs (no optimizer, no gradients)."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, threads: int | None = None):
        _threads(threads)
        from relax.backends.torch_reference import TorchReference

        model_cfg = cfg.model
        if cfg.train.ref_load:  # a reference checkpoint: a Hugging Face directory
            model_cfg = dataclasses.replace(model_cfg, source="hf", path=cfg.train.ref_load)
        self.cfg = cfg
        self.reference = TorchReference(model_cfg, vocab_size=info.vocab_size, pad_token_id=info.pad_token_id,
                                        seed=cfg.seed, temperature=cfg.rollout.temperature, num_threads=threads)

    def ping(self) -> str:
        return "ok"

    def logprobs(self, samples: Samples) -> torch.Tensor:
        return self.reference.compute_logprobs(samples, self.cfg.train.micro_batch_size)


class PolicyWorker:
    """The actor: trains the policy and ships its weights to the rollout engines."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, threads: int | None = None):
        _threads(threads)
        from relax.backends.models import pick_device, pick_dtype
        from relax.backends.torch_train import TorchPolicy

        self.cfg = cfg
        # the dtype weights() ships: the rollout engine's (pick_dtype, same device)
        self.rollout_dtype = pick_dtype(cfg.model, pick_device())
        self.policy = TorchPolicy(cfg.model, cfg.train, vocab_size=info.vocab_size, pad_token_id=info.pad_token_id,
                                  seed=cfg.seed, num_threads=threads, temperature=cfg.rollout.temperature,
                                  total_steps=cfg.train.num_rollout * cfg.train.num_steps_per_rollout)

    def ping(self) -> str:
        return "ok"

    def logprobs(self, samples: Samples) -> torch.Tensor:
        return self.policy.compute_logprobs(samples, self.cfg.train.micro_batch_size)

    def train_step(self, batch: TrainBatch, *, rollout_mismatch: bool = False) -> dict[str, float]:
        """One optimizer step; `rollout_mismatch` on the first step of a rollout (see TorchPolicy.train_step)."""
        t0 = time.perf_counter()
        out = self.policy.train_step(batch, self.cfg.algorithm, per_token=self.cfg.train.calculate_per_token_loss,
                                     micro_batch_size=self.cfg.train.micro_batch_size,
                                     rollout_mismatch=rollout_mismatch)
        out[ACTOR_COMPUTE_TIME] = time.perf_counter() - t0
        return out

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights for the rollout engines, already in their dtype (bf16 halves what Ray ships)."""
        return self.policy.state_dict_for_rollout(dtype=self.rollout_dtype)

    def save(self, directory: str) -> None:
        self.policy.save_checkpoint(directory)

    def load(self, directory: str) -> None:
        self.policy.load_checkpoint(directory)


class RolloutWorker:
    """One embedded rollout engine replica."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, threads: int | None = None):
        _threads(threads)
        from relax.backends.models import build_model, pick_device, pick_dtype
        from relax.backends.rollout_embedded import EmbeddedEngine

        device = pick_device()
        dtype = pick_dtype(cfg.model, device)
        model = build_model(cfg.model, info.vocab_size, info.pad_token_id, seed=cfg.seed, dtype=dtype, device=device)
        model.eval()
        self.cfg = cfg
        self.engine = EmbeddedEngine(model, eos_token_ids=list(info.eos_token_ids), pad_token_id=info.pad_token_id,
                                     device=device)

    def ping(self) -> str:
        return "ok"

    def generate(self, prompts: list[list[int]], *, seed: int, evaluation: bool = False) -> Samples:
        ro = self.cfg.rollout
        t0 = time.perf_counter()
        if evaluation:
            out = self.engine.generate(prompts, n_samples_per_prompt=ro.eval_n_samples_per_prompt,
                                       max_new_tokens=ro.max_response_len,
                                       temperature=ro.eval_temperature, top_p=1.0, top_k=-1, seed=seed)
        else:
            out = self.engine.generate(prompts, n_samples_per_prompt=ro.n_samples_per_prompt,
                                       max_new_tokens=ro.max_response_len, temperature=ro.temperature,
                                       top_p=ro.top_p, top_k=ro.top_k, seed=seed)
        out.engine_time = time.perf_counter() - t0
        return out

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        self.engine.load_weights(state_dict, version)
        return version


class CriticWorker:
    """PPO's value model."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, threads: int | None = None):
        _threads(threads)
        from relax.backends.torch_critic import TorchCritic

        self.cfg = cfg
        self.critic = TorchCritic(cfg.model, cfg.train, cfg.algorithm, vocab_size=info.vocab_size,
                                  pad_token_id=info.pad_token_id, seed=cfg.seed, num_threads=threads,
                                  total_steps=cfg.train.num_rollout * cfg.train.num_steps_per_rollout)

    def ping(self) -> str:
        return "ok"

    def values(self, samples: Samples) -> torch.Tensor:
        return self.critic.compute_values(samples, self.cfg.train.micro_batch_size)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.critic.train_step(batch, self.cfg.algorithm, per_token=self.cfg.train.calculate_per_token_loss,
                                      micro_batch_size=self.cfg.train.micro_batch_size)

    def save(self, directory: str) -> None:
        self.critic.save_checkpoint(directory)

    def load(self, directory: str) -> None:
        self.critic.load_checkpoint(directory)


def compute_advantages(algo_cfg, inputs: AdvantageInputs) -> AdvantageOutput:
    """Rewards (and values, log-probs) to token advantages, by the algorithm's registry entry."""
    return algorithms.get(algo_cfg.name).compute_advantages(algo_cfg, inputs)


class AdvantagesWorker:
    """PPO's advantages service: GAE from critic values, off the driver."""

    def ping(self) -> str:
        return "ok"

    def compute(self, algo_cfg, inputs: AdvantageInputs) -> AdvantageOutput:
        return compute_advantages(algo_cfg, inputs)
