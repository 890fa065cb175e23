"""The role classes. Plain Python, so tests can use them directly; the runner wraps each in `ray.remote`.

Every worker builds its own model from the config (same seed, same initial weights everywhere) and
speaks only `Samples` / `TrainBatch` and state dicts, never a backend's types.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from relax import algorithms
from relax.agents.episode import EpisodeMaker
from relax.algorithms.base import AdvantageInputs, AdvantageOutput
from relax.batch import Samples, TrainBatch, continuation, extend_responses
from relax.config.derive import teacher_model
from relax.config.schema import ModelConfig, RelaxConfig
from relax.config.store import import_plugins
from relax.metrics import ACTOR_COMPUTE_TIME
from relax.models.hf import build_model, pick_device, pick_dtype
from relax.models.lora import inject_adapters
from relax.models.weight_buffers import WeightBuffers, as_state_dict, state_and_bytes
from relax.roles.cores import pin_role_process
from relax.roles.heartbeat import HeartbeatLink, start_heartbeat
from relax.roles.tensor_pickling import install as install_tensor_pickling
from relax.roles.versions import WeightVersions
from relax.rollout.embedded import EmbeddedEngine
from relax.rollout.sglang.weight_sync import WeightSender, WeightTarget
from relax.rollout.vision import prompt_vision
from relax.train.torch_critic import TorchCritic
from relax.train.torch_policy import TorchPolicy
from relax.train.torch_reference import TorchReference
from relax.train.trainer import Policy


@dataclass(frozen=True)
class ModelInfo:
    """What workers need from the tokenizer (the driver loads it once)."""

    vocab_size: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]


WEIGHTS_GROUP = "weights"  # the actor's concurrency group that sends weights to rollout servers (`push_weights`)


def actor_class(cls: type) -> Any:
    """`cls` (an actor role: `PolicyWorker`, `MegatronRank`) as a Ray actor class with a `WEIGHTS_GROUP` thread, where
    callers dispatch `push_weights` (`.options(concurrency_group=WEIGHTS_GROUP)`). Its other methods keep the default
    group's single thread, in the order they are called."""
    import ray

    return ray.remote(concurrency_groups={WEIGHTS_GROUP: 1})(cls)


def _user_modules(cfg: RelaxConfig) -> None:
    """Import the run's `plugins` in this role's process before anything else: they fill its registries (algorithms,
    components looked up by name) as they fill the driver's. Unpickling the config imports only the module that
    defines the algorithm's config class, which need not be the one that registers it."""
    import_plugins(cfg.plugins)


def _threads(n: int | None) -> None:
    if pin_role_process() is None and n:  # pinned (cluster.role_cores): its pools sized to its cores
        torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class FrozenModelWorker:
    """A frozen model that only computes log-probs of response tokens at the rollout temperature (no optimizer, no
    gradients): the reference policy and the distillation teacher."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, model_cfg: ModelConfig, *, threads: int | None = None,
                 heartbeat: HeartbeatLink | None = None):
        _user_modules(cfg)
        install_tensor_pickling()  # this process's Ray calls send tensors as raw buffers
        start_heartbeat(self, heartbeat)
        _threads(threads)

        self.cfg = cfg
        self.model = TorchReference(model_cfg, vocab_size=info.vocab_size, pad_token_id=info.pad_token_id,
                                    seed=cfg.seed, temperature=cfg.rollout.temperature, num_threads=threads,
                                    packed=cfg.train.pack_sequences)

    def ping(self) -> str:
        return "ok"

    def logprobs(self, samples: Samples) -> torch.Tensor:
        t = self.cfg.train
        return self.model.compute_logprobs(samples, t.micro_batch_size, t.max_tokens_per_micro_batch)


class ReferenceWorker(FrozenModelWorker):
    """The reference policy of KL terms: the policy's initial weights, or the checkpoint at train.ref_load."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, threads: int | None = None,
                 heartbeat: HeartbeatLink | None = None):
        model_cfg = cfg.model
        if cfg.train.ref_load:  # a reference checkpoint: a Hugging Face directory
            model_cfg = dataclasses.replace(model_cfg, source="hf", path=cfg.train.ref_load)
        super().__init__(cfg, info, model_cfg, threads=threads, heartbeat=heartbeat)


class TeacherWorker(FrozenModelWorker):
    """The teacher of on-policy distillation (the `teacher` config group), which shares the policy's tokenizer."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, threads: int | None = None,
                 heartbeat: HeartbeatLink | None = None):
        model_cfg = teacher_model(cfg)
        if model_cfg is None:
            raise ValueError(f"algorithm={cfg.algorithm.name} has no teacher")
        super().__init__(cfg, info, model_cfg, threads=threads, heartbeat=heartbeat)


class PolicyForwarding:
    """The actor role's answers, whatever trains: `self.policy` (a `relax.train.trainer.Policy`), the weights of
    published versions kept for stale samples (`self.versions`) and the dtype of the rollout engines
    (`self.rollout_dtype`). `PolicyWorker` (the torch backend) and each `MegatronRank` set those three."""

    cfg: RelaxConfig
    policy: Policy
    versions: WeightVersions
    rollout_dtype: torch.dtype
    _sender: WeightSender | None = None

    def ping(self) -> str:
        return "ok"

    def push_weights(self, weights: WeightBuffers, version: int, urls: list[str], target: WeightTarget,
                     regroup: bool = False) -> dict[str, int]:
        """Send `weights` (a snapshot `weights()` returned, which Ray hands this process from its node's object
        store) of `version` to the SGLang servers at `urls`; {"buckets", "bytes"}. Dispatched to the actor's
        `WEIGHTS_GROUP` thread, it runs beside a train step: it reads only the snapshot, never the model being
        trained."""
        if self._sender is None or self._sender.target != target:
            if self._sender is not None:
                self._sender.close()
            self._sender = WeightSender(target, self.cfg.model)
        return self._sender.push(weights, version, urls, regroup=regroup)

    def logprobs(self, samples: Samples, current: int | None = None) -> torch.Tensor:
        """Log-probs of the response tokens [N, T]: with `current` (the trainer's version now), each token's under the
        weights of the version that generated it (see `WeightVersions`); without, every token's under the current
        weights."""
        mbs, max_tokens = self.cfg.train.micro_batch_size, self.cfg.train.max_tokens_per_micro_batch
        if current is None:
            return self.policy.compute_logprobs(samples, mbs, max_tokens)
        return self.versions.logprobs(samples, current,
                                      lambda part: self.policy.compute_logprobs(part, mbs, max_tokens))

    def train_step(self, batch: TrainBatch, rollout_mismatch: bool = False) -> dict[str, float]:
        """One optimizer step; `rollout_mismatch` on the first step of a rollout (see PolicyTrainer.train_step)."""
        t0 = time.perf_counter()
        out = self.policy.train_step(batch, self.cfg.algorithm, per_token=self.cfg.train.calculate_per_token_loss,
                                     micro_batch_size=self.cfg.train.micro_batch_size,
                                     max_tokens=self.cfg.train.max_tokens_per_micro_batch,
                                     rollout_mismatch=rollout_mismatch)
        out[ACTOR_COMPUTE_TIME] = time.perf_counter() - t0
        return out

    def weights(self, version: int | None = None) -> WeightBuffers:
        """The weights for the rollout engines, already in their dtype (bf16 halves what Ray ships), as byte
        arrays that Ray ships without pickling. With `version` and train.max_staleness > 0, a copy is kept for
        `logprobs` of samples that version generates, as long as they can still be trained (versions older than
        `version - max_staleness` are dropped)."""
        if version is not None:
            self.versions.remember(version)
        return WeightBuffers.of(self.policy.state_dict_for_rollout(dtype=self.rollout_dtype))

    def save(self, directory: str) -> None:
        self.policy.save_checkpoint(directory)

    def load(self, directory: str) -> None:
        self.policy.load_checkpoint(directory)


class PolicyWorker(PolicyForwarding):
    """The actor on the torch backend: trains the policy and ships its weights to the rollout engines."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, threads: int | None = None,
                 heartbeat: HeartbeatLink | None = None):
        _user_modules(cfg)
        install_tensor_pickling()  # this process's Ray calls send tensors as raw buffers
        start_heartbeat(self, heartbeat)
        _threads(threads)

        self.cfg = cfg
        # the dtype weights() ships: the rollout engine's (pick_dtype, same device)
        self.rollout_dtype = pick_dtype(cfg.model, pick_device())
        self.policy = TorchPolicy(cfg.model, cfg.train, vocab_size=info.vocab_size, pad_token_id=info.pad_token_id,
                                  seed=cfg.seed, num_threads=threads, temperature=cfg.rollout.temperature,
                                  lora_sync=cfg.rollout.lora_sync, routing_replay=cfg.rollout.routing_replay)
        # weights of published versions that stale samples may still come from (asynchronous modes): those an
        # optimizer step changes (a LoRA policy's adapters)
        self.versions = WeightVersions(self.policy.trainable_params, keep=cfg.train.max_staleness)

    def reference_logprobs(self, samples: Samples) -> torch.Tensor:
        """A LoRA policy's reference log-probs: its base model, the adapters off (the plan starts no reference)."""
        t = self.cfg.train
        return self.policy.compute_reference_logprobs(samples, t.micro_batch_size, t.max_tokens_per_micro_batch)


class HybridWorker(PolicyWorker):
    """The actor and the one embedded rollout replica in one process (`Plan.rollout_in_actor`: sync mode on a CPU
    machine, where they take turns): the policy's methods, and the rollout's (`generate`, `resume`, `abort`,
    `load_weights`) on an engine of its own, built as a `RolloutWorker` builds it. The process beats for the actor;
    its death is the actor's (the graph restarts from the last checkpoint)."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, threads: int | None = None,
                 heartbeat: HeartbeatLink | None = None):
        super().__init__(cfg, info, threads=threads, heartbeat=heartbeat)
        self.rollout = RolloutWorker(cfg, info, threads=threads)

    def generate(self, prompts: list[list[int]], **kwargs) -> Samples:
        return self.rollout.generate(prompts, **kwargs)

    def resume(self, partial: Samples, **kwargs) -> Samples:
        return self.rollout.resume(partial, **kwargs)

    def abort(self, gen_id: int) -> None:
        self.rollout.abort(gen_id)

    def load_weights(self, weights: WeightBuffers | dict[str, torch.Tensor], version: int) -> int:
        return self.rollout.load_weights(weights, version)


class RolloutWorker:
    """One embedded rollout engine replica.

    With partial rollout the runner calls `abort`, and with rollout.stage_weights `stage_weights`, while
    `generate`/`resume` runs (a Ray actor with a thread for each); `load_weights` comes between generations.
    """

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, threads: int | None = None,
                 heartbeat: HeartbeatLink | None = None):
        _user_modules(cfg)
        install_tensor_pickling()  # this process's Ray calls send tensors as raw buffers
        start_heartbeat(self, heartbeat)
        _threads(threads)

        device = pick_device()
        dtype = pick_dtype(cfg.model, device)
        model = build_model(cfg.model, info.vocab_size, info.pad_token_id, seed=cfg.seed, dtype=dtype, device=device)
        adapters: list[str] = []
        if cfg.model.lora_rank > 0 and cfg.rollout.lora_sync == "adapter":  # updates carry the adapters alone

            adapters = inject_adapters(model, cfg.model)
        model.eval()
        self.cfg = cfg
        self.engine = EmbeddedEngine(model, eos_token_ids=list(info.eos_token_ids), pad_token_id=info.pad_token_id,
                                     device=device)
        self.engine.adapter_keys = frozenset(adapters)
        self.engine.record_routes = cfg.rollout.routing_replay or cfg.rollout.record_routes  # an MoE model's experts
        self._abort: int | None = None  # the generation id `abort` asked to interrupt
        self.episodes = EpisodeMaker.for_config(cfg)  # None: single-turn responses

    def ping(self) -> str:
        return "ok"

    def _sampling(self, evaluation: bool) -> dict:
        ro = self.cfg.rollout
        # an episode's limit is on all its tokens, and each of its turns is limited to max_response_len
        limits = dict(max_new_tokens=self._response_limit(),
                      turn_limit=ro.max_response_len if self.episodes is not None else None)
        if evaluation:
            return dict(temperature=ro.eval_temperature, top_p=ro.eval_top_p, top_k=-1, **limits)
        return dict(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, **limits)

    def _response_limit(self) -> int:
        """Tokens of one response: an episode's (`rollout.max_episode_tokens`), else `rollout.max_response_len`."""
        ro = self.cfg.rollout
        return ro.max_episode_tokens if self.episodes is not None else ro.max_response_len

    def _new_episodes(self, items: list | None, n: int) -> list | None:
        if self.episodes is None:
            return None
        if items is None:
            raise ValueError("RolloutWorker.generate: an agentic rollout needs the prompt items")
        return self.episodes.new_for(items, n)

    def _should_abort(self, gen_id: int | None):
        return None if gen_id is None else (lambda: self._abort == gen_id)

    def generate(self, prompts: list[list[int]], *, seed: int, evaluation: bool = False,
                 sample_ids: torch.Tensor | None = None, gen_id: int | None = None,
                 items: list | None = None) -> Samples:
        """Responses to `prompts` (n_samples_per_prompt each, or eval_n_samples_per_prompt), drawn from the random
        streams of (`seed`, `sample_ids`); `gen_id` names the call for `abort` (None: not interruptible). `items`:
        the prompts' items, which an agentic rollout's episodes start from."""
        n = self.cfg.rollout.eval_n_samples_per_prompt if evaluation else self.cfg.rollout.n_samples_per_prompt
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, n_samples_per_prompt=n, seed=seed, sample_ids=sample_ids,
                                   should_abort=self._should_abort(gen_id), episodes=self._new_episodes(items, n),
                                   vision=prompt_vision(items), **self._sampling(evaluation))
        out.engine_time = time.perf_counter() - t0
        return out

    def resume(self, partial: Samples, *, seed: int, gen_id: int | None = None) -> Samples:
        """Continue interrupted responses (`partial`, finish_reason "abort") with the current weights: each row's
        prompt and response so far are prefilled, and its random stream continues where it stopped."""

        t0 = time.perf_counter()
        job = continuation(partial, self._response_limit())
        sampling = self._sampling(evaluation=False)
        sampling["max_new_tokens"] = int(job.budgets.max())
        episodes = None
        if self.episodes is not None:  # the running episodes again: their loops reset and earlier turns replayed
            episodes = self.episodes.restore_all(partial.episodes)
        more = self.engine.generate(job.prompts, seed=seed, sample_ids=job.sample_ids, positions=job.positions,
                                    budgets=job.budgets, should_abort=self._should_abort(gen_id), episodes=episodes,
                                    vision=partial.vision, **sampling)
        more.engine_time = time.perf_counter() - t0
        return extend_responses(partial, more, pad_token_id=self.engine.pad_token_id)

    def abort(self, gen_id: int) -> None:
        """Interrupt generation `gen_id` after its current token (no effect once it has returned)."""
        self._abort = gen_id

    def load_weights(self, weights: WeightBuffers | dict[str, torch.Tensor], version: int) -> int:
        """Load `weights` of `version` (swapped in if `stage_weights` staged them); returns the bytes they took
        (tied weights once)."""
        state, nbytes = state_and_bytes(weights)
        self.engine.load_weights(state, version)
        return nbytes

    def stage_weights(self, weights: WeightBuffers | dict[str, torch.Tensor], version: int) -> bool:
        """Copy `weights` of `version` beside the generation in progress (a thread of its own:
        rollout.stage_weights), for the next `load_weights` of that version; False: skipped (not newer)."""
        return self.engine.stage_weights(as_state_dict(weights), version)


class CriticWorker:
    """PPO's value model."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, threads: int | None = None,
                 heartbeat: HeartbeatLink | None = None):
        _user_modules(cfg)
        install_tensor_pickling()  # this process's Ray calls send tensors as raw buffers
        start_heartbeat(self, heartbeat)
        _threads(threads)

        self.cfg = cfg
        self.critic = TorchCritic(cfg.model, cfg.train, cfg.algorithm, vocab_size=info.vocab_size,
                                  pad_token_id=info.pad_token_id, seed=cfg.seed, num_threads=threads)

    def ping(self) -> str:
        return "ok"

    def values(self, samples: Samples) -> torch.Tensor:
        t = self.cfg.train
        return self.critic.compute_values(samples, t.micro_batch_size, t.max_tokens_per_micro_batch)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        t = self.cfg.train
        return self.critic.train_step(batch, self.cfg.algorithm, per_token=t.calculate_per_token_loss,
                                      micro_batch_size=t.micro_batch_size, max_tokens=t.max_tokens_per_micro_batch)

    def save(self, directory: str) -> None:
        self.critic.save_checkpoint(directory)

    def load(self, directory: str) -> None:
        self.critic.load_checkpoint(directory)


def compute_advantages(algo_cfg, inputs: AdvantageInputs) -> AdvantageOutput:
    """Rewards (and values, log-probs) to token advantages, by the algorithm's registry entry."""
    return algorithms.get(algo_cfg.name).compute_advantages(algo_cfg, inputs)


class AdvantagesWorker:
    """PPO's advantages service: GAE from critic values, off the driver. `plugins`: the run's `plugins`, imported
    first as every role does (the algorithm's `compute_advantages` is looked up by name in this process's registry)."""

    def __init__(self, *, plugins: list[str] | tuple[str, ...] = (), heartbeat: HeartbeatLink | None = None):
        import_plugins(plugins)
        install_tensor_pickling()  # this process's Ray calls send tensors as raw buffers
        start_heartbeat(self, heartbeat)
        pin_role_process()

    def ping(self) -> str:
        return "ok"

    def compute(self, algo_cfg, inputs: AdvantageInputs) -> AdvantageOutput:
        return compute_advantages(algo_cfg, inputs)
