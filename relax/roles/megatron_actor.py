"""The actor role on the Megatron backend: one Ray actor per trainer rank, behind the PolicyWorker interface.

`MegatronActorGroup` starts `world_size` rank actors (in a placement group's bundles when given, one GPU
each on a GPU cluster), lets rank 0 pick the rendezvous address, and then forwards every PolicyWorker call to
all ranks (they are collectives) and returns rank 0's answer. It is a plain class: the driver can hold it, or
the runner can wrap it in `ray.remote(...)` like the other roles (it then needs no resources of its own: the
ranks hold them).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from relax.batch import Samples, TrainBatch
from relax.config.schema import RelaxConfig
from relax.models.hf import pick_device, pick_dtype
from relax.models.weight_buffers import WeightBuffers
from relax.roles.heartbeat import HeartbeatLink, start_heartbeat
from relax.roles.tensor_pickling import install as install_tensor_pickling
from relax.roles.versions import WeightVersions
from relax.roles.workers import ModelInfo, PolicyForwarding, _threads, _user_modules, actor_class

RANK0_METHODS = frozenset({"push_weights"})  # not collectives: rank 0 holds the gathered weights and sends them
SETUP_TIMEOUT_S = 900.0
CALL_TIMEOUT_S = 3600.0  # the group's own blocking methods (direct use); the runner bounds its waits by heartbeats
QUIET_WARNINGS = (r"(Apex is not installed|Transformer Engine and Apex are not installed|full scope is deprecated"
                  r"|When using async grad allreduce)")


class MegatronRank(PolicyForwarding):
    """One rank of the Megatron trainer (a Ray actor): process group, megatron parallel state, MegatronPolicy; the
    actor role's calls as `PolicyWorker` answers them (`PolicyForwarding`), on every rank."""

    def __init__(self, cfg: RelaxConfig, info: ModelInfo, *, rank: int, world_size: int,
                 threads: Optional[int] = None, use_distributed_optimizer: bool = False,
                 heartbeat: Optional[HeartbeatLink] = None) -> None:
        _user_modules(cfg)  # the run's plugins first, as the torch backend's roles: the algorithm's registry entry
        install_tensor_pickling()  # this process's Ray calls send tensors as raw buffers
        start_heartbeat(self, heartbeat)
        _threads(threads or (None if torch.cuda.is_available() else 1))
        # megatron-core's notes about optional packages this backend does not use (Apex, Transformer Engine)
        warnings.filterwarnings("ignore", category=UserWarning, message=QUIET_WARNINGS)
        self.cfg, self.info = cfg, info
        self.rank, self.world_size = rank, world_size
        self.use_distributed_optimizer = use_distributed_optimizer
        self.policy: Any = None
        self._store: Any = None  # rank 0's rendezvous store, from `rendezvous`

    def rendezvous(self) -> tuple[str, int]:
        """(address, port) for the process group (rank 0 only): this node's IP and the port of the store this rank
        hosts, listening on that address alone. The store binds port 0, so the kernel picks a free port as it binds:
        no other process can take it before the ranks meet (a port found free and bound later can be)."""
        import ray

        from relax.models.rendezvous import listening_store

        address = ray.util.get_node_ip_address()
        self._store = listening_store(address, 0, world_size=self.world_size)
        return address, int(self._store.port)

    def setup(self, master_addr: str, master_port: int) -> str:
        """Join the process group and build the policy (all ranks at once: it is a rendezvous)."""
        from relax.train.megatron import parallel
        from relax.train.megatron.policy import MegatronPolicy

        cfg, t = self.cfg, self.cfg.train
        parallel.initialize(self.rank, self.world_size, master_addr=master_addr, master_port=master_port,
                            store=self._store,
                            tensor_parallel_size=t.tensor_parallel_size,
                            pipeline_parallel_size=t.pipeline_parallel_size,
                            expert_parallel_size=t.expert_parallel_size, seed=cfg.seed)
        device = pick_device()
        compute = pick_dtype(cfg.model, device)
        # GPUs: Megatron's mixed precision (bf16 parameters, fp32 master weights and gradients); CPU: fp32
        # parameters with bf16 autocast where the torch backend would use it.
        params_dtype = compute if device.type == "cuda" else torch.float32
        self.rollout_dtype = compute
        self.policy = MegatronPolicy(
            cfg.model, t, vocab_size=self.info.vocab_size, pad_token_id=self.info.pad_token_id, seed=cfg.seed,
            temperature=cfg.rollout.temperature,
            use_distributed_optimizer=self.use_distributed_optimizer, params_dtype=params_dtype,
            routing_replay=cfg.rollout.routing_replay,
        )
        self.policy.gather_bucket_bytes = cfg.rollout.sglang.bucket_mb << 20  # pipeline stages send in such buckets
        module = self.policy._module()  # this rank's shards: what a kept version copies
        self.versions = WeightVersions(lambda: {k: p.data for k, p in module.named_parameters()},
                                       keep=t.max_staleness)
        return "ok"

    def save_hf(self, directory: str) -> None:
        self.policy.save_hf(directory)

    def shutdown(self) -> None:
        from relax.train.megatron import parallel
        parallel.shutdown()


class MegatronActorGroup:
    """The actor role as TP x PP x DP Ray actors; the PolicyWorker interface, answered by rank 0."""

    def __init__(
        self,
        cfg: RelaxConfig,
        info: ModelInfo,
        *,
        world_size: Optional[int] = None,
        placement_group: Any = None,
        bundle_indices: Optional[list[int]] = None,
        num_gpus_per_rank: Optional[float] = None,
        num_cpus_per_rank: float = 1,
        threads: Optional[int] = None,
        use_distributed_optimizer: Optional[bool] = None,
        setup_timeout_s: float = SETUP_TIMEOUT_S,
        rank_options: Optional[list[dict[str, Any]]] = None,
        rank_cls: type = MegatronRank,
        heartbeats: Optional[list[Optional[HeartbeatLink]]] = None,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        """`world_size`: ranks (default: `cluster.actor_gpus` on a GPU cluster, else TP x PP).
        `placement_group`/`bundle_indices`: rank i goes to bundle `bundle_indices[i]` (default i).
        `num_gpus_per_rank`: default 1 when `cluster.actor_gpus > 0`, else 0 (CPU ranks over gloo).
        `use_distributed_optimizer`: default: when there is more than one data-parallel rank.
        `rank_options`: the Ray options of each rank (the runner's plan), instead of the four above.
        `rank_cls`: the class each rank runs (tests substitute a placeholder).
        `heartbeats`: each rank's heartbeat link (`relax.roles.heartbeat`), or None.
        `call_timeout_s`: the bound of the group's own methods (`ping`, `train_step`, ...) on their answers."""
        import ray

        t = cfg.train
        model_parallel = t.tensor_parallel_size * t.pipeline_parallel_size
        if world_size is None:
            world_size = cfg.cluster.actor_gpus if cfg.cluster.actor_gpus > 0 else model_parallel
        if world_size % model_parallel:
            raise ValueError(f"world size {world_size} is not a multiple of train.tensor_parallel_size * "
                             f"train.pipeline_parallel_size = {model_parallel}")
        if use_distributed_optimizer is None:
            use_distributed_optimizer = world_size // model_parallel > 1
        gpus = num_gpus_per_rank if num_gpus_per_rank is not None else (1 if cfg.cluster.actor_gpus > 0 else 0)
        remote = actor_class(rank_cls)
        self.ranks = []
        self._others: list = []  # refs of ranks 1.. of earlier calls, checked for errors on the next call
        self.call_timeout_s = call_timeout_s
        self.remote = _RemoteMethods(self)
        for rank in range(world_size):
            options: dict[str, Any] = dict(num_cpus=num_cpus_per_rank, num_gpus=gpus)
            if rank_options is not None:
                options = dict(rank_options[rank])
            elif placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                bundle = bundle_indices[rank] if bundle_indices is not None else rank
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle)
            self.ranks.append(remote.options(**options).remote(
                cfg, info, rank=rank, world_size=world_size, threads=threads,
                use_distributed_optimizer=use_distributed_optimizer,
                heartbeat=heartbeats[rank] if heartbeats is not None else None))
        try:
            addr, port = ray.get(self.ranks[0].rendezvous.remote(), timeout=setup_timeout_s)
            ray.get([r.setup.remote(addr, port) for r in self.ranks], timeout=setup_timeout_s)
        except BaseException:
            self.kill()
            raise

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start `method` on every rank (a collective); rank 0's ObjectRef. The other ranks' results are checked
        for errors at the next call (a failed rank also fails rank 0's collective). `RANK0_METHODS` go to rank 0
        alone."""
        import ray

        if method in RANK0_METHODS:
            return getattr(self.ranks[0], method).remote(*args, **kwargs)

        if self._others:
            done, self._others = ray.wait(self._others, num_returns=len(self._others), timeout=0)
            ray.get(done, timeout=60)  # finished: raises the error of a rank that failed
        args = tuple(ray.put(a) if isinstance(a, Samples) else a for a in args)  # one copy for every rank
        refs = [getattr(r, method).remote(*args, **kwargs) for r in self.ranks]
        self._others.extend(refs[1:])
        return refs[0]

    def _all(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on every rank and wait for all of them; rank 0's result. For direct use of the group (tests,
        notebooks): the runner calls `remote` and waits through its watchdog (`relax.runner.watchdog`)."""
        import ray

        first = self.call(method, *args, **kwargs)
        out = ray.get(first, timeout=self.call_timeout_s)
        ray.get(self._others, timeout=self.call_timeout_s)
        self._others = []
        return out

    def ping(self) -> str:
        return self._all("ping")

    def logprobs(self, samples: Samples, current: int | None = None) -> torch.Tensor:
        return self._all("logprobs", samples, current)

    def train_step(self, batch: TrainBatch, *, rollout_mismatch: bool = False) -> dict[str, float]:
        """One optimizer step over the whole batch (every rank takes its data-parallel rows); rank 0's metrics."""
        return self._all("train_step", batch, rollout_mismatch)

    def weights(self, version: int | None = None) -> WeightBuffers:
        """HF-layout weights in the rollout dtype (`WeightBuffers`), gathered on rank 0 (tied `lm_head.weight`
        left out); with `version`, every rank keeps a copy of its shards for the old log-probs of that version's
        samples."""
        return self._all("weights", version)

    def save(self, directory: str) -> None:
        self._all("save", directory)

    def load(self, directory: str) -> None:
        self._all("load", directory)

    def save_hf(self, directory: str) -> None:
        """A Hugging Face checkpoint of the current weights (loadable by AutoModelForCausalLM.from_pretrained)."""
        self._all("save_hf", directory)

    def kill(self) -> None:
        """End every rank's process (no collective: works when a rank is dead or hung)."""
        import ray

        for r in self.ranks:
            try:
                ray.kill(r)
            except Exception:  # already gone
                pass
        self.ranks = []


class _RemoteMethods:
    """`group.remote.<method>.remote(...)`: the group called like a Ray actor handle (an ObjectRef of rank 0's
    result), so that the runner drives the Megatron actor exactly as the torch one. `.options(...)` (a concurrency
    group) applies to `RANK0_METHODS`, which rank 0 answers alone."""

    def __init__(self, group: MegatronActorGroup):
        self._group = group

    def __getattr__(self, method: str) -> Any:
        group = self._group

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                return group.call(method, *args, **kwargs)

            @staticmethod
            def options(**options: Any) -> Any:
                if method not in RANK0_METHODS:
                    raise ValueError(f"{method} runs on every rank: no per-call options")
                return getattr(group.ranks[0], method).options(**options)

        return _Method
