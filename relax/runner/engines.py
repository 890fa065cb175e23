"""The embedded rollout engines: `RolloutWorker` Ray actors, one per replica, called directly.

Implements `relax.runner.rollout_stream.Engines` (as does `relax.runner.sglang_engines.SGLangEngines`), so the
loop and the stream do not know which backend generates.
"""

from __future__ import annotations

import torch

from relax.backends.batch import Samples, concat_samples


class ReplicaEngines:
    """Prompts dealt to the replicas in turn; each sample draws from its own random stream, so the split changes
    nothing."""

    def __init__(self, replicas: list, pad_token_id: int):
        self.replicas, self.pad_token_id = replicas, pad_token_id

    def start(self) -> ReplicaEngines:
        return self  # the replicas are Ray actors the cluster started and pinged

    def generate(self, prompts: list[list[int]], sample_ids: torch.Tensor, *, seed: int, gen_id: int | None = None,
                 evaluation: bool = False) -> Samples:
        import ray

        n, G = len(self.replicas), len(sample_ids) // len(prompts)
        groups = sample_ids.view(len(prompts), G)
        refs = [r.generate.remote(prompts[i::n], seed=seed, evaluation=evaluation, sample_ids=groups[i::n].reshape(-1),
                                  gen_id=gen_id)
                for i, r in enumerate(self.replicas) if prompts[i::n]]
        return self._merge(ray.get(refs))

    def resume(self, partial: Samples, *, seed: int, gen_id: int | None = None) -> Samples:
        import ray

        n = len(self.replicas)
        refs = [r.resume.remote(partial.select(slice(i, None, n)), seed=seed, gen_id=gen_id)
                for i, r in enumerate(self.replicas) if i < len(partial)]
        return self._merge(ray.get(refs))

    def _merge(self, parts: list[Samples]) -> Samples:
        if len(parts) == 1:
            return parts[0]
        merged = concat_samples(parts, self.pad_token_id)
        return merged.select(torch.argsort(merged.sample_id))

    def abort(self, gen_id: int) -> None:
        for r in self.replicas:
            r.abort.remote(gen_id)

    def load_weights(self, weights, version: int) -> None:
        import ray

        ray.get([r.load_weights.remote(weights, version) for r in self.replicas])

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
