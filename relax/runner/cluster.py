"""The service graph on Ray: starts the roles of a plan, calls them, and tears everything down.

The driver never touches a model; it only holds actor handles. Ray is started for `cluster=local`
(and shut down on exit, Ctrl-C included) or joined at `cluster.address`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from relax.algorithms.base import AdvantageInputs, AdvantageOutput
from relax.batch import Samples, TrainBatch
from relax.config.core_rules import format_cores
from relax.config.schema import RelaxConfig
from relax.roles.heartbeat import HeartbeatBoard, HeartbeatLink, interval_for
from relax.roles.megatron_actor import MegatronActorGroup, MegatronRank
from relax.roles.sglang_server import EngineServer
from relax.roles.tensor_pickling import install as install_tensor_pickling
from relax.roles.workers import (
    AdvantagesWorker,
    CriticWorker,
    HybridWorker,
    ModelInfo,
    PolicyWorker,
    ReferenceWorker,
    RolloutWorker,
    TeacherWorker,
    actor_class,
    compute_advantages,
)
from relax.runner import checkpoint
from relax.runner.errors import RoleFailure, RunError
from relax.runner.plan import (
    LOCAL_RAY_SYSTEM_CONFIG,
    ROLE_START_TIMEOUT_S,
    Plan,
    ray_options,
    ray_source,
    reserve,
)
from relax.runner.ray_auth import enable_token_auth
from relax.runner.ray_logs import plain_ray_log_prefix
from relax.runner.restarts import Restarts
from relax.runner.reward_model import worker_class
from relax.runner.watchdog import Watchdog


def local_gpu_problem(cfg: RelaxConfig, plan: Plan) -> str | None:
    """Why a local Ray instance cannot get the plan's GPUs from this machine (None: it can, or the run joins a Ray
    cluster: `cluster.address` or RAY_ADDRESS). A check before Ray (`relax.runner.preflight`) and at its start."""
    if cfg.cluster.address is not None or os.environ.get("RAY_ADDRESS"):
        return None
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if plan.total_gpus <= have:
        return None
    return (f"cluster={cfg.cluster.name} plans {plan.total_gpus} GPU(s) on a local Ray instance, but torch sees "
            f"{have} CUDA device(s) on this machine; use cluster=local (CPU) or a cluster option that fits the machine")


class RayRuntime:
    """Ray for a run, as `relax.runner.plan.ray_source` decides it: a local instance started (`cluster=local`, shut
    down on exit, Ctrl-C included), the cluster at `cluster.address` (or RAY_ADDRESS) joined, or the Ray that this
    process already runs in (a sweep job's) used as it is. Lives across restarts of the service graph."""

    def __init__(self, cfg: RelaxConfig, plan: Plan):
        self.cfg, self.plan, self.started = cfg, plan, False
        self.joined: str | None = None  # the address of the cluster joined (None: a local instance, or not started)

    def __enter__(self) -> RayRuntime:
        import ray

        install_tensor_pickling()  # the driver's calls send tensors as raw buffers, as the roles' replies do
        source = ray_source(self.cfg)  # the decision the plan's `Ray:` line states
        if source.how == "running":  # a sweep job: the sweep's Ray, which the launcher started or joined
            return self
        # roles inherit the driver's environment on a local Ray: no per-file progress bars from model loading
        os.environ.setdefault("TQDM_DISABLE", "1")
        plain_ray_log_prefix(os.environ, (sys.stdout, sys.stderr))  # roles' lines go to either; no colour in a file
        address = source.address
        kwargs = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True,
                      configure_logging=True)
        if source.option == "RAY_ADDRESS":
            # A Ray job's driver (relax-submit) gets RAY_ADDRESS from Ray's job supervisor; ray.init() would join
            # that cluster anyway and then refuse num_cpus/num_gpus. Join it on purpose, and say so.
            try:
                job_id = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")["metadata"][
                    "job_submission_id"]
            except (ValueError, KeyError, TypeError):
                job_id = None
            why = (f"this process runs inside Ray job {job_id}" if job_id is not None
                   else "RAY_ADDRESS is set")
            print(f"Ray: cluster.address is unset and {why}: joining the Ray cluster at {address} "
                  "(RAY_ADDRESS), not starting a local Ray instance", file=sys.stderr, flush=True)
        if address is None:
            if (problem := local_gpu_problem(self.cfg, self.plan)) is not None:
                raise RunError(problem)
            kwargs["num_cpus"] = max(self.plan.cpu_threads, 2)
            kwargs["num_gpus"] = self.plan.total_gpus or None
            kwargs["_system_config"] = LOCAL_RAY_SYSTEM_CONFIG
        if address is not None:
            enable_token_auth()  # a cluster with token authentication refuses a driver that does not send it
        try:
            # "local": a new instance of this run's own, never one that a session file names (a head stopped by a
            # signal leaves /tmp/ray/ray_current_cluster behind; a user's `ray start --head` writes it too)
            ray.init(address=address if address is not None else "local", **kwargs)
        except (TypeError, AttributeError):
            raise  # a mistake in this call (Relax's own), not a Ray that cannot start
        except Exception as exc:  # noqa: BLE001 Ray raises a bare Exception too ("The current node timed out
            # during startup": its raylet's 30 s under heavy load); every failure of its start is this one line
            if ray.is_initialized():  # a start that failed half-way: nothing of it is left for the next job
                ray.shutdown()
            named = "" if source.option != "RAY_ADDRESS" else f" from RAY_ADDRESS={address}"
            raise RunError(f"cannot start or join Ray (cluster.address={self.cfg.cluster.address}{named}): "
                           f"{exc}") from None
        self.started = True
        self.joined = address
        return self

    def __exit__(self, *exc) -> None:
        import ray

        if self.started and ray.is_initialized():
            ray.shutdown()
        self.started = False


class Cluster:
    def __init__(self, cfg: RelaxConfig, plan: Plan, info: ModelInfo, restarts: Restarts | None = None):
        """`restarts`: the run's count of restarts, which embedded rollout replicas replaced in place draw on
        (None: a dead replica fails the call)."""
        self.cfg, self.plan, self.info, self.restarts = cfg, plan, info, restarts
        self._ray: RayRuntime | None = None  # when this cluster started Ray itself
        self.actors: list = []
        self._pings: dict | None = None  # launched: each role's first answer, by process name

    # ------------------------------------------------------------------ lifecycle
    def launch(self) -> Cluster:
        """Start every role's process without waiting for it to answer, so that the driver can do other work (open
        its MLflow run) while the roles import torch and build their models; `__enter__` then waits for them.
        On failure nothing is left running."""
        import ray

        if self._pings is not None:
            return self
        if not ray.is_initialized():
            self._ray = RayRuntime(self.cfg, self.plan).__enter__()
        try:
            self._start_roles(wait=False)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __enter__(self) -> Cluster:
        """Every role started (by `launch`, or now) and answering."""
        self.launch()
        try:
            self._wait_for_roles()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _remote(self, cls, role: str, replica: int, *args, **kwargs):
        """One process of `role`, with exactly the Ray options of `plan.ray_options` (the placement rule), sending
        heartbeats under its process name."""
        import ray

        name = self._process_name(role, replica)
        options = ray_options(self.plan, role, replica, self.placement_group, self.hide_gpus)
        remote = actor_class(cls) if role == "actor" else ray.remote(cls)
        actor = remote.options(**options).remote(*args, heartbeat=self._link(name), **kwargs)
        self.actors.append(actor)
        self.processes.append(name)
        self.watch.register(actor, name)
        return actor

    def _process_name(self, role: str, replica: int) -> str:
        return f"{role}[{replica}]" if self.plan.role(role).replicas > 1 else role

    def _link(self, name: str) -> HeartbeatLink | None:
        if self.watch.board is None:
            return None
        return HeartbeatLink(self.watch.board, name, interval_for(self.cfg.cluster.heartbeat_timeout_s))

    def _start_board(self) -> Watchdog:
        """The heartbeat board (a named actor: `relax-heartbeats-<id>`, no CPU reserved) and the driver's watchdog."""
        import ray

        timeout = self.cfg.cluster.heartbeat_timeout_s
        if timeout is None:
            return Watchdog(None, None)
        board = ray.remote(HeartbeatBoard).options(num_cpus=0, name=f"relax-heartbeats-{uuid.uuid4().hex[:12]}",
                                                   max_concurrency=4).remote()
        self.board = board
        return Watchdog(board, timeout)

    def _start_roles(self, timeout_s: float | None = None, wait: bool = True) -> None:
        """Reserve the plan's placement group, start every role and (with `wait`) wait, bounded, until each
        answers."""
        import ray

        cfg, info, threads = self.cfg, self.info, self.plan.threads
        self.processes: list[str] = []  # names of self.actors' processes
        self.watch = self._start_board()
        self.hide_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.placement_group = reserve(self.plan)  # None on a CPU cluster
        self._timeout = timeout = ROLE_START_TIMEOUT_S if timeout_s is None else timeout_s
        with self._starting():
            if cfg.train.backend == "megatron":
                self.actor = self._megatron_actor(timeout)
            else:
                worker = HybridWorker if self.plan.rollout_in_actor else PolicyWorker
                self.actor = self._remote(worker, "actor", 0, cfg, info, threads=threads("actor"))
            self.actor_process = self.processes[0]  # the process that answers the actor's calls (rank 0)
            if cfg.train.backend != "megatron":
                self.actor_ranks = [(self.actor, self.actor_process)]
            # the rollout's processes; the engines over them are the rollout driver's
            # (relax.runner.rollout_driver.engines.started_engines)
            replicas = self.plan.role("rollout").replicas
            if self.plan.rollout_in_actor:  # a death of that process is the actor's: no replacement in place
                self.rollout_replicas, self.rollout_names = [self.actor], [self.actor_process]
            elif cfg.rollout.backend == "sglang":
                # the run's private directory (0700: mkdtemp) of engine configs, logs and adapters; __exit__ removes it
                self.sglang_log_dir = Path(tempfile.mkdtemp(prefix="relax-sglang-"))
                self.rollout_names = [self._process_name("rollout", i) for i in range(replicas)]
                self.rollout_replicas = [] if cfg.rollout.sglang.urls is not None else \
                    [self.start_server(i) for i in range(replicas)]
            else:
                self.rollout_names = [self._process_name("rollout", i) for i in range(replicas)]
                self.rollout_replicas = [self._remote(RolloutWorker, "rollout", i, cfg, info,
                                                      threads=threads("rollout")) for i in range(replicas)]
            self.reference = None
            if self.plan.has("reference"):
                self.reference = self._remote(ReferenceWorker, "reference", 0, cfg, info, threads=threads("reference"))
            self.teacher = None
            if self.plan.has("teacher"):
                self.teacher = self._remote(TeacherWorker, "teacher", 0, cfg, info, threads=threads("teacher"))
            self.critic = self._remote(CriticWorker, "critic", 0, cfg, info, threads=threads("critic")) \
                if self.plan.has("critic") else None
            self.adv = self._remote(AdvantagesWorker, "advantages", 0, plugins=list(cfg.plugins)) \
                if self.plan.has("advantages") else None
            self.reward_model = None  # reward_model=classifier|judge: the role holding its model (None: no process)
            if (rm_worker := worker_class(cfg)) is not None:
                self.reward_model = self._remote(rm_worker, "reward_model", 0, cfg, threads=threads("reward_model"))
            self._pings = {a.ping.remote(): name for a, name in zip(self.actors, self.processes, strict=True)}
        if wait:
            self._wait_for_roles()

    def _wait_for_roles(self) -> None:
        """Until every launched role answers (at most the start timeout)."""
        import ray

        pings, timeout = self._pings, self._timeout
        with self._starting():
            ready, waiting = ray.wait(list(pings), num_returns=len(pings), timeout=timeout)
            ray.get(ready, timeout=timeout)
            if waiting:
                raise RunError(f"role(s) {', '.join(pings[w] for w in waiting)} did not start within {timeout:g} s "
                               f"(Ray has {ray.available_resources()} available)")

    @contextlib.contextmanager
    def _starting(self) -> Iterator[None]:
        """While roles start: any failure releases the placement group; a role that died says so (RunError)."""
        import ray

        try:
            yield
        except ray.exceptions.RayActorError as exc:
            self._release_placement()
            raise RunError(f"a role failed to start: {exc}") from None
        except BaseException:
            self._release_placement()
            raise

    def replace_rollout_replica(self, i: int):
        """A new embedded rollout replica i in place of a dead or hung one (same resources), once it answers."""
        import ray

        name = self._process_name("rollout", i)
        old = self.actors[self.processes.index(name)]
        try:
            ray.kill(old)  # a hung one holds its resources until it is gone
        except Exception:  # already dead
            pass
        if self.watch.board is not None:
            self.watch.board.forget.remote(name)
        self.actors.pop(self.processes.index(name))
        self.processes.remove(name)
        replica = self._remote(RolloutWorker, "rollout", i, self.cfg, self.info, threads=self.plan.threads("rollout"))
        try:
            ray.get(replica.ping.remote(), timeout=ROLE_START_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise RoleFailure(name, f"could not be replaced: {exc}") from None
        return replica

    def start_server(self, i: int):
        """rollout=sglang: a new engine server actor for rollout replica i on the plan's rollout resources (it starts
        its server process when the engines call its `start`)."""
        return self._remote(EngineServer, "rollout", i, self.cfg, i, threads=self.plan.threads("rollout"),
                            log_dir=str(self.sglang_log_dir))

    def _megatron_actor(self, timeout: float):
        """The Megatron actor: one Ray actor per rank with the plan's options (a rank per actor GPU, or on the CPU
        cores), joined in one process group; driven like an actor handle (`group.remote`)."""
        import ray

        world = self.plan.role("actor").replicas
        options = [ray_options(self.plan, "actor", i, self.placement_group, self.hide_gpus) for i in range(world)]
        try:
            names = [f"actor[{i}]" if world > 1 else "actor" for i in range(world)]
            group = MegatronActorGroup(self.cfg, self.info, world_size=world, rank_options=options,
                                       threads=self.plan.threads("actor"), setup_timeout_s=timeout,
                                       rank_cls=MegatronRank, heartbeats=[self._link(n) for n in names])
        except ray.exceptions.GetTimeoutError:
            raise RunError(f"the {world} Megatron rank(s) of the actor did not start within {timeout:g} s "
                           f"(Ray has {ray.available_resources()} available)") from None
        except ray.exceptions.RayTaskError as exc:  # e.g. a model the backend cannot build at this parallelism
            raise RunError(f"the Megatron actor failed to start: {exc.cause!r}") from None
        self.actors.extend(group.ranks)
        self.processes.extend(names)
        self.actor_ranks = list(zip(group.ranks, names, strict=True))  # who sends weights (Plan.weight_senders)
        for rank, name in zip(group.ranks, names, strict=True):
            self.watch.register(rank, name)
        return group.remote

    def _release_placement(self) -> None:
        """Remove the plan's placement group (and with it any actor still in it); for __exit__ as well."""
        if getattr(self, "placement_group", None) is None:
            return
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.placement_group)
        self.placement_group = None

    def _remove_run_dir(self, failed: bool) -> None:
        """The SGLang engines' directory (configs, logs, adapters) goes with the run's servers; after a failure its
        logs stay for the user (private to them), and the path is said."""
        directory = getattr(self, "sglang_log_dir", None)
        if directory is None or not Path(directory).exists():
            return
        if failed:
            print(f"SGLang engine logs of the failed run kept in {directory}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(directory, ignore_errors=True)
        self.sglang_log_dir = None  # said or removed once (a failed start exits the cluster twice)

    def __exit__(self, exc_type, exc, tb) -> None:
        import ray

        if getattr(self, "board", None) is not None:
            self.actors.append(self.board)
            self.board = None
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # already dead
                pass
        self.actors, self._pings = [], None
        self._remove_run_dir(failed=exc_type is not None)
        if ray.is_initialized():
            self._release_placement()  # a joined cluster gets its GPUs back before the next run of this process
        if self._ray is not None:
            self._ray.__exit__(None, None, None)
            self._ray = None

    def cpu_placement(self) -> dict[str, dict]:
        """cluster.role_cores: each pinned process's cores and torch thread counts as the process itself reports them
        (`relax.roles.cores.cpu_placement`), by process name; RunError when one differs from the plan (every thread
        on exactly its cores, as many intra- and inter-op threads as cores)."""
        import ray

        from relax.roles.cores import cpu_placement

        placed, wrong = {}, []
        for actor, name in zip(self.actors, self.processes, strict=True):
            role, _, replica = name.partition("[")
            cores = self.plan.cores_of(role, int(replica.rstrip("]") or 0))
            if cores is None:
                continue
            got = ray.get(actor.__ray_call__.remote(cpu_placement), timeout=self._timeout)
            placed[name] = got
            n = len(cores)
            if got["cores"] != cores or got["thread_cores"] != cores or (got["intra_op"], got["inter_op"]) != (n, n):
                wrong.append(f"{name} runs on cores {format_cores(got['thread_cores'])} with {got['intra_op']} "
                             f"intra-op / {got['inter_op']} inter-op torch threads, planned: cores "
                             f"{format_cores(cores)}, {n} / {n}")
        if wrong:
            raise RunError("cluster.role_cores: " + "; ".join(wrong))
        return placed

    # ------------------------------------------------------------------ calls
    def weights(self, version: int):
        """The actor's current weights (of `version`) for the engines: an ObjectRef, taken before the actor's next
        step (calls to the actor run in order), that each engine fetches from the object store."""
        return self.actor.weights.remote(version)

    def actor_logprobs(self, samples: Samples, current: int | None = None) -> torch.Tensor:
        """The actor's log-probs of `samples`; with `current` (its version now), at each token's own version."""
        return self.watch.get_one(self.actor.logprobs.remote(samples, current), self.actor_process)

    def reference_logprobs(self, samples: Samples) -> torch.Tensor:
        """The reference's log-probs: its role's, or a LoRA actor's own base model (`Plan.reference_on_actor`)."""
        if self.reference is None:
            return self.watch.get_one(self.actor.reference_logprobs.remote(samples), self.actor_process)
        return self.watch.get_one(self.reference.logprobs.remote(samples), "reference")

    def teacher_logprobs(self, samples: Samples) -> torch.Tensor:
        return self.watch.get_one(self.teacher.logprobs.remote(samples), "teacher")

    def reward_model_call(self, method: str, *args):
        """The answer of the reward model's role to `method(*args)` (from the rollout stream's scoring thread)."""
        if self.reward_model is None:
            raise RunError(f"reward_model.{method}: the plan has no reward_model process")
        return self.watch.get_one(getattr(self.reward_model, method).remote(*args), "reward_model")

    def values(self, samples: Samples) -> torch.Tensor:
        return self.watch.get_one(self.critic.values.remote(samples), "critic")

    def advantages(self, algo_cfg, inputs: AdvantageInputs) -> AdvantageOutput:
        if self.adv is not None:
            return self.watch.get_one(self.adv.compute.remote(algo_cfg, inputs), "advantages")
        return compute_advantages(algo_cfg, inputs)

    def train_step(self, batch: TrainBatch, *, actor: bool, rollout_mismatch: bool) -> dict[str, float]:
        """One optimizer step on `batch` (a global batch) of the critic, where there is one, and, with `actor`, of
        the actor (`rollout_mismatch`: see PolicyTrainer.train_step), at the same time; their metrics merged."""
        calls = []
        if self.critic is not None:
            calls.append((self.critic.train_step.remote(batch), "critic"))
        if actor:
            calls.append((self.actor.train_step.remote(batch, rollout_mismatch=rollout_mismatch), self.actor_process))
        merged: dict[str, float] = {}
        for m in self.watch.get(calls):
            merged.update(m)
        return merged

    def save(self, checkpoints: checkpoint.Checkpoints, step: int, state: dict, rollout: dict | None = None) -> Path:
        """Write the roles' weights and optimizer states (and `rollout`, the rollout stream's state) to a staging
        directory, then commit it atomically."""
        staging = checkpoints.staging(step)
        if rollout is not None:
            checkpoint.write_rollout_state(staging, rollout)
        calls = [(self.actor.save.remote(str(staging / "policy")), self.actor_process)]
        if self.cfg.train.save_hf and self.cfg.train.backend == "megatron":
            # the Megatron policy as a Hugging Face directory too (the torch backend's policy/ is one already)
            calls.append((self.actor.save_hf.remote(str(staging / "hf")), self.actor_process))
        if self.critic is not None:
            calls.append((self.critic.save.remote(str(staging / "critic")), "critic"))
        self.watch.get(calls, progress=False, deadline=self._checkpoint_deadline())
        return checkpoints.commit(staging, step, state)

    def load(self, path: Path) -> dict:
        calls = [(self.actor.load.remote(str(path / "policy")), self.actor_process)]
        if self.critic is not None:
            calls.append((self.critic.load.remote(str(path / "critic")), "critic"))
        self.watch.get(calls, progress=False, deadline=self._checkpoint_deadline())
        return checkpoint.read_state(path)

    def _checkpoint_deadline(self) -> tuple[float, str]:
        return self.cfg.train.checkpoint_timeout_s, "train.checkpoint_timeout_s"
