"""The service graph on Ray: starts the roles of a plan, calls them, and tears everything down.

The driver never touches a model; it only holds actor handles. Ray is started for `cluster=local`
(and shut down on exit, Ctrl-C included) or joined at `cluster.address`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from relax.algorithms.base import AdvantageInputs, AdvantageOutput
from relax.backends.batch import Samples, TrainBatch, concat_samples
from relax.config.schema import RelaxConfig
from relax.metrics import ACTOR_COMPUTE_TIME, CRITIC_ONLY
from relax.roles.workers import (
    AdvantagesWorker,
    CriticWorker,
    ModelInfo,
    PolicyWorker,
    RolloutWorker,
    compute_advantages,
)
from relax.runner import checkpoint
from relax.runner.errors import RunError
from relax.runner.plan import Plan

_SUMMED = {ACTOR_COMPUTE_TIME}  # times add up over the optimizer steps of a rollout; other metrics average


def _average(metrics: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for m in metrics for k in m}
    return {k: sum(m[k] for m in metrics if k in m) / (1 if k in _SUMMED else sum(1 for m in metrics if k in m))
            for k in keys}


class Cluster:
    def __init__(self, cfg: RelaxConfig, plan: Plan, info: ModelInfo):
        self.cfg, self.plan, self.info = cfg, plan, info
        self.started_ray = False
        self.actors: list = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Cluster:
        import ray

        if not ray.is_initialized():
            # roles inherit the driver's environment on a local Ray: no per-file progress bars from model loading
            os.environ.setdefault("TQDM_DISABLE", "1")
            address = self.cfg.cluster.address
            kwargs = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True,
                          configure_logging=True)
            if address is None:
                kwargs["num_cpus"] = max(self.plan.cpu_threads, 2)
                kwargs["num_gpus"] = self.plan.total_gpus or None
            try:
                ray.init(address=address, **kwargs)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise RunError(f"cannot start or join Ray (cluster.address={address}): {exc}") from None
            self.started_ray = True
        try:
            self._start_roles()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _remote(self, cls, role: str, *args, **kwargs):
        import ray

        r = self.plan.role(role)
        actor = ray.remote(cls).options(num_cpus=r.cpus, num_gpus=r.gpus, max_concurrency=1).remote(*args, **kwargs)
        self.actors.append(actor)
        return actor

    def _start_roles(self) -> None:
        import ray

        cfg, info, threads = self.cfg, self.info, self.plan.cpu_threads
        self.actor = self._remote(PolicyWorker, "actor", cfg, info, threads=threads)
        replicas = self.plan.role("rollout").replicas
        self.rollouts = [self._remote(RolloutWorker, "rollout", cfg, info, threads=threads) for _ in range(replicas)]
        self.reference = None
        if self.plan.has("reference"):
            self.reference = self._remote(PolicyWorker, "reference", cfg, info, threads=threads,
                                          weights_dir=cfg.train.ref_load)
        self.critic = self._remote(CriticWorker, "critic", cfg, info, threads=threads) if self.plan.has("critic") \
            else None
        self.adv = self._remote(AdvantagesWorker, "advantages") if self.plan.has("advantages") else None
        try:
            ray.get([a.ping.remote() for a in self.actors])
        except ray.exceptions.RayActorError as exc:
            raise RunError(f"a role failed to start: {exc}") from None

    def __exit__(self, exc_type, exc, tb) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # already dead
                pass
        self.actors = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False

    # ------------------------------------------------------------------ calls
    def generate(self, prompts: list[list[int]], *, seed: int, evaluation: bool = False) -> Samples:
        import ray

        n = len(self.rollouts)
        shards = [prompts[i::n] for i in range(n)] if n > 1 else [prompts]
        # strided shards balance prompt lengths across engines; each engine keeps its groups consecutive
        refs = [r.generate.remote(s, seed=seed + 7919 * i, evaluation=evaluation)
                for i, (r, s) in enumerate(zip(self.rollouts, shards, strict=True)) if s]
        parts = ray.get(refs)
        if n == 1:
            return parts[0]
        # put responses back in prompt order: shard i holds prompts i, i+n, ...
        merged = concat_samples(parts)
        per_prompt = len(merged) // len(prompts)
        order, offsets = [], [0]
        for p in parts[:-1]:
            offsets.append(offsets[-1] + len(p))
        for j in range(len(prompts)):
            shard, k = j % n, j // n
            start = offsets[shard] + k * per_prompt
            order.extend(range(start, start + per_prompt))
        return merged.select(torch.tensor(order))

    def actor_logprobs(self, samples: Samples) -> torch.Tensor:
        import ray

        return ray.get(self.actor.logprobs.remote(samples))

    def reference_logprobs(self, samples: Samples) -> torch.Tensor:
        import ray

        return ray.get(self.reference.logprobs.remote(samples))

    def values(self, samples: Samples) -> torch.Tensor:
        import ray

        return ray.get(self.critic.values.remote(samples))

    def advantages(self, algo_cfg, inputs: AdvantageInputs) -> AdvantageOutput:
        import ray

        if self.adv is not None:
            return ray.get(self.adv.compute.remote(algo_cfg, inputs))
        return compute_advantages(algo_cfg, inputs)

    def train(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """num_steps_per_rollout optimizer steps, each on one consecutive slice of the rollout."""
        import ray

        steps = self.cfg.train.num_steps_per_rollout
        size = self.cfg.train.global_batch_size
        critic_only = step < getattr(self.cfg.algorithm, "num_critic_only_steps", 0)
        metrics = []
        for k in range(steps):
            chunk = batch.select(slice(k * size, (k + 1) * size))
            refs = []
            if self.critic is not None:
                refs.append(self.critic.train_step.remote(chunk))
            if not critic_only:
                refs.append(self.actor.train_step.remote(chunk))
            merged: dict[str, float] = {}
            for m in ray.get(refs):
                merged.update(m)
            metrics.append(merged)
        out = _average(metrics)
        if critic_only:
            out[CRITIC_ONLY] = 1.0
        return out

    def sync_weights(self, version: int) -> None:
        import ray

        weights = self.actor.weights.remote()  # an ObjectRef: each engine fetches it from the object store
        ray.get([r.load_weights.remote(weights, version) for r in self.rollouts])

    def save(self, save_dir: Path, step: int, state: dict) -> Path:
        import ray

        staging = checkpoint.staging_dir(save_dir, step)
        refs = [self.actor.save.remote(str(staging / "policy"))]
        if self.critic is not None:
            refs.append(self.critic.save.remote(str(staging / "critic")))
        ray.get(refs)
        return checkpoint.commit(staging, checkpoint.step_dir(save_dir, step), state)

    def load(self, path: Path) -> dict:
        import ray

        refs = [self.actor.load.remote(str(path / "policy"))]
        if self.critic is not None:
            refs.append(self.critic.load.remote(str(path / "critic")))
        ray.get(refs)
        return checkpoint.read_state(path)
