"""The embedded rollout engines: `RolloutWorker` Ray actors, one per replica, called directly.

Implements `relax.runner.rollout_driver.stream.Engines` (as does
`relax.runner.rollout_driver.sglang_engines.SGLangEngines`), so the loop and the stream do not know which backend
generates.

A replica that dies (or hangs: `relax.runner.watchdog`) is replaced in place: a new actor on the same resources,
given the weights the others hold, and its share of the call is generated again there. Every sample draws from
its own random stream, so the regenerated share is the one the dead replica would have returned: nothing is lost
or generated twice. Replacements draw on the run's `train.max_restarts` (`relax.runner.restarts.Restarts`); beyond
it the failure goes up to the loop (which stops).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from relax.batch import Samples, concat_samples
from relax.metrics import SYNC_BYTES
from relax.runner.errors import RoleFailure
from relax.runner.restarts import Restarts
from relax.runner.rollout_driver.sglang_engines import SGLangEngines, actor_push
from relax.runner.watchdog import Watchdog

if TYPE_CHECKING:
    from relax.runner.cluster import Cluster
    from relax.runner.rollout_driver.stream import Engines


class ReplicaEngines:
    """Prompts dealt to the replicas in turn; each sample draws from its own random stream, so the split changes
    nothing. `replace(i)` starts a new replica i (answering, without weights); None: replicas are not replaced."""

    def __init__(self, replicas: list, pad_token_id: int, *, watch: Watchdog, names: list[str],
                 replace: Callable[[int], Any] | None = None, restarts: Restarts | None = None):
        self.replicas, self.pad_token_id, self.watch, self.names = replicas, pad_token_id, watch, names
        self.replace, self.restarts = replace, restarts
        self._weights: tuple[Any, int] | None = None  # what the replicas hold (a state dict or its ObjectRef)
        self._sync_bytes: float | None = None  # of the last weight update (perf/sync_bytes)
        self._staging: tuple[int, list] | None = None  # (version, the replicas' stage_weights calls) in flight
        self._staging_lock = threading.Lock()

    def start(self) -> ReplicaEngines:
        return self  # the replicas are Ray actors the cluster started and pinged

    def generate(self, prompts: list[list[int]], sample_ids: torch.Tensor, *, seed: int, gen_id: int | None = None,
                 evaluation: bool = False, items: list | None = None,
                 cancel: threading.Event | None = None) -> Samples:
        n, G = len(self.replicas), len(sample_ids) // len(prompts)
        groups = sample_ids.view(len(prompts), G)

        def call(i: int):
            return self.replicas[i].generate.remote(prompts[i::n], seed=seed, evaluation=evaluation,
                                                    sample_ids=groups[i::n].reshape(-1), gen_id=gen_id,
                                                    items=None if items is None else items[i::n])

        return self._merge(self._run(call, [i for i in range(n) if prompts[i::n]]))

    def resume(self, partial: Samples, *, seed: int, gen_id: int | None = None) -> Samples:
        n = len(self.replicas)
        return self._merge(self._run(lambda i: self.replicas[i].resume.remote(partial.select(slice(i, None, n)),
                                                                             seed=seed, gen_id=gen_id),
                                     [i for i in range(n) if i < len(partial)]))

    def _run(self, call: Callable[[int], Any], which: list[int]) -> list[Any]:
        """`call(i)` on each replica i of `which`, answers in that order; a replica that fails is replaced and
        called again."""
        refs = {i: call(i) for i in which}
        out: dict[int, Any] = {}
        while refs:
            i = next(iter(refs))
            try:
                out[i] = self.watch.get_one(refs.pop(i), self.names[i])
            except RoleFailure as failure:
                if failure.process != self.names[i]:
                    raise  # another role (the actor whose weights it loads) failed
                self._replace(i, failure)
                refs[i] = call(i)
        return [out[i] for i in which]

    def _replace(self, i: int, failure: RoleFailure) -> None:
        if self.replace is None or self.restarts is None:
            raise failure
        self.restarts.replace_in_place(failure)  # re-raises it beyond train.max_restarts
        self.replicas[i] = self.replace(i)
        if self._weights is not None:
            weights, version = self._weights
            self.watch.get_one(self.replicas[i].load_weights.remote(weights, version), self.names[i])

    def _merge(self, parts: list[Samples]) -> Samples:
        if len(parts) == 1:
            return parts[0]
        merged = concat_samples(parts, self.pad_token_id)
        return merged.select(torch.argsort(merged.sample_id))

    def abort(self, gen_id: int) -> None:
        for r in self.replicas:
            r.abort.remote(gen_id)

    def wake(self) -> None:
        """Nothing to wake: the embedded engines' calls end at their abort (`cancel` is for agent programs' runs)."""

    def stage_weights(self, weights, version: int) -> None:
        """Have every replica copy `weights` of `version` beside its generation (`RolloutWorker.stage_weights`);
        returns at once. The next `load_weights` of that version waits for the copies and swaps them in."""
        refs = [r.stage_weights.remote(weights, version) for r in self.replicas]
        with self._staging_lock:  # the loop's thread stages, the rollout stream's pump loads
            self._staging = (version, refs)

    def load_weights(self, weights, version: int) -> None:
        self._weights = (weights, version)
        with self._staging_lock:  # (a newer version being staged stays for its own load)
            staging = self._staging if self._staging is not None and self._staging[0] <= version else None
            if staging is not None:
                self._staging = None
        if staging is not None and staging[0] == version:  # wait for the copies in flight rather than copy again
            for i, ref in enumerate(staging[1]):
                try:
                    self.watch.get_one(ref, self.names[i])
                except RoleFailure:
                    pass  # the replica's load below fails too, and replaces it
        sizes = self._run(lambda i: self.replicas[i].load_weights.remote(weights, version),
                          list(range(len(self.replicas))))
        self._sync_bytes = float(max(sizes))

    def metrics(self) -> dict[str, float]:
        """The bytes of the last weight update (replacements are counted by the run's Restarts)."""
        return {} if self._sync_bytes is None else {SYNC_BYTES: self._sync_bytes}

    def close(self) -> None:
        pass


@contextlib.contextmanager
def started_engines(cluster: Cluster) -> Iterator[Engines]:
    """The rollout engines over the rollout processes `cluster` started, answering, and closed on exit (before the
    cluster kills the processes): embedded replicas (or the actor's own engine, `Plan.rollout_in_actor`), or SGLang
    servers behind the router (`rollout=sglang`: the servers' processes and the router start here)."""
    cfg, info = cluster.cfg, cluster.info
    engines: ReplicaEngines | SGLangEngines
    if cluster.plan.rollout_in_actor:
        engines = ReplicaEngines(cluster.rollout_replicas, info.pad_token_id, watch=cluster.watch,
                                 names=cluster.rollout_names)
    elif cfg.rollout.backend == "sglang":
        engines = SGLangEngines(cfg, eos_token_ids=info.eos_token_ids, pad_token_id=info.pad_token_id,
                                log_dir=cluster.sglang_log_dir,
                                start_server=None if cfg.rollout.sglang.urls is not None else cluster.start_server,
                                push=actor_push(cluster.actor, cluster.watch, cluster.actor_process,
                                                ranks=cluster.actor_ranks,
                                                timeout_s=cfg.rollout.sglang.request_timeout_s),
                                senders=list(cluster.plan.weight_senders))
        engines.servers = list(cluster.rollout_replicas)
    else:
        engines = ReplicaEngines(cluster.rollout_replicas, info.pad_token_id, watch=cluster.watch,
                                 names=cluster.rollout_names, replace=cluster.replace_rollout_replica,
                                 restarts=cluster.restarts)
    try:
        yield engines.start()
    finally:
        engines.close()
