"""The training recipe, top to bottom: rollout -> rewards -> advantages -> train -> publish weights.

Everything that can fail because of user input (model path, data, reward function) is checked
before Ray starts. Roles are Ray actors created from the plan; the loop below only calls their
methods and moves `Samples` / `TrainBatch` between them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from relax import algorithms
from relax.algorithms.base import AdvantageInputs
from relax.batch import FinishReason, Samples, TrainBatch
from relax.config.core_rules import format_cores
from relax.config.evaluation import eval_pass_ks, evaluates, saves_eval_samples
from relax.config.schema import RelaxConfig
from relax.data.datasets import PromptItem
from relax.metrics import (
    ACTOR_COMPUTE_TIME,
    BUFFER_SIZE,
    OVERHEAD_FRACTION,
    OVERHEAD_TIME,
    REWARD_TIMEOUTS,
    ROLLOUT_ENGINE_TIME,
    ROLLOUT_IDLE_FRAC,
    ROLLOUT_TIME,
    STEP_TIME,
    SYNC_TIME,
    TOKENS_PER_S,
    TRAIN_IDLE_FRAC,
    TRAIN_TIME,
)
from relax.rollout.sampling import NonFiniteLogitsError
from relax.runner import checkpoint
from relax.runner.branch_rows import branch_advantages, expand, per_turn_rewards
from relax.runner.cluster import Cluster, RayRuntime
from relax.runner.errors import RoleFailure, RunError, step_name
from relax.runner.eval_samples import eval_sample_records, response_texts
from relax.runner.mismatch_gate import MismatchGate
from relax.runner.optimizer_steps import FailedRewardSteps, SkippedSteps, train_on_rollout
from relax.runner.plan import Plan, build_plan
from relax.runner.preempt import Preempted, Preemption, signal_name
from relax.runner.preflight import (  # noqa: F401 (prepare, check_teacher, _check_megatron_model: their old home)
    Inputs,
    _check_megatron_model,
    check_teacher,
    preflight,
    prepare,
)
from relax.runner.restarts import Restarts
from relax.runner.reward_model import make_scorer, reward_model_metrics
from relax.runner.rollout_driver.engines import started_engines
from relax.runner.rollout_driver.scoring import (
    FilterStats,
    Scorer,
    count_metrics,
    kept_groups,
    score,
    trained_rewards,
    turn_token_rewards,
)
from relax.runner.rollout_driver.stream import Engines, RolloutStream, sample_ids
from relax.runner.session import RunResult, Session
from relax.runner.step_metrics import (
    eval_metrics,
    filter_metrics,
    latest_version_mask,
    overlong_metrics,
    rollout_metrics,
    rollout_mismatch,
    staleness_metrics,
    truncated_masked_metrics,
)

EVAL_SEED_OFFSET = 7_777  # eval samples draw from other random streams than the training samples of the same ids


def filter_note(cfg: RelaxConfig, step: int, stats: FilterStats, batch_groups: int) -> str | None:
    """The warning of a step whose dynamic sampling reached `rollout.max_filter_rounds` with too few groups carrying
    a learning signal (its batch filled with groups without one); None when the batch was filled with signal."""
    if not stats.filled_groups:
        return None
    return (f"{step_name(step)}: only {batch_groups - stats.filled_groups} of {batch_groups} groups carry a learning "
            f"signal after rollout.max_filter_rounds={cfg.rollout.max_filter_rounds} rounds; the batch is filled with "
            f"{stats.filled_groups} group(s) without one")


def old_logprobs(cfg: RelaxConfig, samples: Samples, cluster: Cluster, step: int) -> torch.Tensor | None:
    """The one place that decides which log-probs are "old" (the policy that produced the batch).

    - `algorithm.use_rollout_logprobs`: the rollout engine's own log-probs.
    - Otherwise the actor recomputes them, each token at the weights that generated it (the trainer's version
      `step`, or an older one for stale samples of the asynchronous modes), when anything reads them before the
      first optimizer step would: stale tokens, a second optimizer step on the same rollout, the rollout
      correction (TIS, rejection), reward-side KL (REINFORCE++, PPO), advantages that read them (distillation), or
      the parity gate (train.mismatch_gate, which measures the mismatch before the update).
    - Otherwise None: the batch is exactly on-policy for its one optimizer step, and the trainer uses its own
      current log-probs, detached (the same values, without a second forward pass).
    """
    a = cfg.algorithm
    if a.use_rollout_logprobs:
        return samples.rollout_logp
    stale = bool((samples.versions()[samples.response_mask.bool()] < step).any())
    if stale or cfg.train.num_steps_per_rollout > 1 or a.use_tis or a.rollout_mask != "none" or a.kl_coef != 0 \
            or algorithms.get(a.name).advantages_read_old_logp or cfg.train.mismatch_gate != "off":
        return cluster.actor_logprobs(samples, step)
    return None


def loss_rows(cfg: RelaxConfig, samples: Samples, keep: torch.Tensor) -> torch.Tensor:
    """[N] bool: the responses whose tokens count in the loss: those of the `keep` groups, less, with
    `algorithm.mask_truncated`, those that ended by length (finish_reason "length")."""
    if not cfg.algorithm.mask_truncated:
        return keep
    return keep & torch.tensor([r != FinishReason.LENGTH for r in samples.finish_reason], dtype=torch.bool)


@contextlib.contextmanager
def _refusing_broken_weights(step: int) -> Iterator[None]:
    """The rollout engine's refusal to sample from non-finite logits, as the run's error (on Ray its cause)."""
    try:
        yield
    except NonFiniteLogitsError as exc:
        raise RunError(f"{step_name(step)}: the rollout engine stopped: {getattr(exc, 'cause', exc)}") from None


def train_batch(cfg: RelaxConfig, plan: Plan, cluster: Cluster, samples: Samples, rewards: torch.Tensor,
                keep: torch.Tensor, step: int) -> tuple[TrainBatch, dict[str, float]]:
    """Old, reference and teacher log-probs and values as the plan needs them, then the algorithm's advantages over
    the kept groups (`keep` [N] bool). Left-out responses get a zero mask, so no loss, statistic or denominator sees
    them; so do truncated responses with `algorithm.mask_truncated` (`loss_rows`), whose rewards still enter their
    group's baseline: the advantage hook sees their rows with a zero mask. Returns the batch and the metrics of the
    advantage hook (and of the train/rollout mismatch, when the actor recomputed the old log-probs)."""
    G = cfg.rollout.n_samples_per_prompt
    # agent runs that forked: every branch a row, with its run's reward and group (relax.runner.branch_rows)
    branched = expand(samples)
    turn_total = rewards  # what turn_token_rewards spreads over a row (data.turn_rewards=per_turn)
    if branched.layers > 1:
        turn_total = per_turn_rewards(branched, rewards)
        samples, keep, rewards = branched.samples, keep[branched.run], rewards[branched.run]
    old_logp = old_logprobs(cfg, samples, cluster, step)
    ref_logp = cluster.reference_logprobs(samples) if plan.has("reference") or plan.reference_on_actor else None
    teacher_logp = cluster.teacher_logprobs(samples) if plan.has("teacher") else None
    values = cluster.values(samples) if plan.has("critic") else None
    rows = keep.nonzero().squeeze(-1)
    mask = samples.response_mask * loss_rows(cfg, samples, keep)[:, None].to(samples.response_mask.dtype)
    if cfg.rollout.mask_offpolicy_in_partial_rollout:  # tokens of older versions than their response's last
        mask = mask * latest_version_mask(samples)

    def kept(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[rows]

    # ended by the model or its episode (a stop token, an environment's end), not cut by a token limit
    stopped = torch.tensor([r not in (FinishReason.LENGTH, FinishReason.ABORT) for r in samples.finish_reason])
    lengths = samples.response_mask.sum(1)
    given = rewards  # [N]; an episode's turns each rewarded on their last token with data.turn_rewards=per_turn
    if cfg.data.turn_rewards == "per_turn":
        given = turn_token_rewards(samples, turn_total)
    out = branch_advantages(lambda inputs: cluster.advantages(cfg.algorithm, inputs),
                            AdvantageInputs(given[rows], mask[rows].float(), G, kept(old_logp), kept(ref_logp),
                                            kept(values), kept(teacher_logp), stopped=stopped[rows],
                                            lengths=lengths[rows]), branched.layer[rows])
    full = torch.zeros(mask.shape, dtype=out.advantages.dtype)
    returns = None if out.returns is None else full.clone().index_copy_(0, rows, out.returns)
    batch = TrainBatch.from_samples(samples, rewards=rewards, advantages=full.index_copy_(0, rows, out.advantages),
                                    old_logp=old_logp, ref_logp=ref_logp, returns=returns, old_values=values)
    batch.token_mask = samples.present()  # what the model attends to stays whole; the loss reads the mask below
    batch.response_mask = mask
    metrics = dict(out.metrics)
    if old_logp is not None and not cfg.algorithm.use_rollout_logprobs:
        metrics.update(rollout_mismatch(cfg.algorithm, old_logp, samples.rollout_logp, mask, samples.constrained))
    return batch, metrics


def run(cfg: RelaxConfig, plan: Plan | None = None, *, output_dir: Path, dictconfig=None) -> RunResult:
    """Train `cfg` to the end (or resume it); returns the logged history and the reward summary.

    A role process that dies or hangs (`RoleFailure`) restarts the service graph from the latest checkpoint (or
    from step 0 without one) in the same MLflow run, up to `train.max_restarts` times (`Restarts`). Ray itself
    (`RayRuntime`) lives across those restarts.

    Ctrl-C and SIGTERM (`relax.runner.preempt`): with `train.save_on_preempt`, the loop finishes its step, writes
    its checkpoint and raises `Preempted` (a KeyboardInterrupt: the MLflow run ends KILLED); a second signal, or any
    without it, raises `Preempted` at once.
    """

    plan = plan or build_plan(cfg)
    runtime = RayRuntime(cfg, plan)  # entered by the first attempt, once the user's inputs are checked
    restarts = Restarts(cfg.train.max_restarts)
    start = StartState()  # the attempts': earlier runs' checkpoints set aside, whether a step began
    preemption = Preemption.from_config(cfg)  # Ctrl-C / SIGTERM: a checkpoint of the current step, then stop
    try:
        with preemption:
            try:
                while True:
                    try:
                        return Recipe(cfg, plan, runtime, restarts, preemption, output_dir=output_dir,
                                      dictconfig=dictconfig, start=start).train()
                    except RoleFailure as failure:
                        if preemption.requested is not None:  # stopping anyway: no restart (the signal may have hit it)
                            print(f"{step_name(restarts.step)}: {failure}; not restarted: the run is stopping "
                                  f"({signal_name(preemption.requested)})", file=sys.stderr, flush=True)
                            raise Preempted(preemption.requested) from None
                        cfg = restarts.next(cfg, failure)
            finally:
                start.ended()  # before the message's latest checkpoint is read (below)
    except KeyboardInterrupt as interrupt:
        exc = preemption.as_preempted(interrupt)
        if not isinstance(exc, Preempted):  # Ctrl-C without our handler (before or after the run's context)
            raise
        exc.latest = checkpoint.latest(checkpoint.resolve_save_dir(cfg))  # for relax-train's message
        exc.joined = runtime.joined  # what stopped: the run's actors on a cluster that goes on, or its own Ray
        if exc is interrupt:
            raise
        raise exc from None
    finally:
        runtime.__exit__(None, None, None)


class StepTimer:
    """The wall-clock phases of one step, for its perf/* metrics: each `phase(name)` block timed, the step itself from
    the timer's start to `metrics`."""

    def __init__(self):
        self.start = time.perf_counter()
        self.spans = {"rollout": 0.0, "train": 0.0, "sync": 0.0}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.spans[name] += time.perf_counter() - t

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def metrics(self, step_time: float, engine_time: float, actor_compute_time: float,
                tokens: float) -> dict[str, float]:
        """The step's timings; the overhead is what neither the engines nor the actor's compute account for, at least
        0: the engines' time is measured by the engines, and may overlap the actor's compute or exceed the driver's
        view of the step by their clocks' and calls' slack (a negative overhead was logged)."""
        overhead = max(0.0, step_time - engine_time - actor_compute_time)
        return {
            ROLLOUT_TIME: self.spans["rollout"],
            ROLLOUT_ENGINE_TIME: engine_time,
            TRAIN_TIME: self.spans["train"],
            SYNC_TIME: self.spans["sync"],
            STEP_TIME: step_time,
            OVERHEAD_TIME: overhead,
            OVERHEAD_FRACTION: overhead / max(step_time, 1e-9),
            TOKENS_PER_S: tokens / max(step_time, 1e-9),
        }


@dataclasses.dataclass
class StartState:
    """What the attempts of one run share about its start (a restart before any step starts it again)."""

    # (where, where to) of each earlier run's checkpoint that the run's fresh start moved to `earlier/`
    set_aside: list[tuple[Path, Path]] = dataclasses.field(default_factory=list)
    save_dir: Path | None = None  # the directory they were moved out of
    began: bool = False  # the first step (or an evaluation-only run's evaluation) began: the run started

    def ended(self) -> None:
        """The run ends (`run` returns or raises) with no step begun: the earlier runs' checkpoints its fresh start set
        aside go back where they were (`checkpoint.put_back`), so `train.resume=auto` still continues the earlier
        run, whatever stopped it: a start step that failed, a role failure past `train.max_restarts`, Ctrl-C or
        SIGTERM, also between two attempts. The one place that decides it: while `run` restarts the service graph
        from step 0 they stay aside (the next attempt must not find them: `Restarts.next` would resume the earlier
        run's checkpoint), and once a step began they are the run's to keep aside. The attempt has released the
        directory's lock by now, so `put_back` takes it."""
        if self.began or not self.set_aside or self.save_dir is None:
            return
        checkpoint.put_back(self.save_dir, self.set_aside, locked=False)
        self.set_aside.clear()


class Recipe:
    """One start of the service graph, trained to the end, in the manner of torchtune's recipes: `setup` checks the
    user's inputs and starts everything, `step` runs one training step, `train` does both.

    The rollout side runs in a `RolloutStream` whatever the mode: it generates the batch of each step with the
    weights its mode allows (sync: the current ones; hybrid: one step old; fully_async: up to max_staleness
    steps old), ahead of the loop where the mode allows, and the loop takes them in step order.
    """

    def __init__(self, cfg: RelaxConfig, plan: Plan, runtime: RayRuntime, restarts: Restarts,
                 preemption: Preemption, *, output_dir: Path, dictconfig=None, start: StartState | None = None):
        self.cfg, self.plan, self.runtime, self.restarts, self.preemption = cfg, plan, runtime, restarts, preemption
        self.output_dir, self.dictconfig = output_dir, dictconfig
        self.start = start if start is not None else StartState()
        self.checkpoints: checkpoint.Checkpoints | None = None

    def train(self) -> RunResult:
        with contextlib.ExitStack() as stack:
            self.setup(stack)  # a start that fails puts the moves back once the run ends (`StartState.ended`)
            self.start.began = True
            with self.stream:
                self.session.progress.begin()  # the eta's pace: from the first step on, not the start-up
                for step in range(self.start_step, self.cfg.train.num_rollout):
                    self.step(step)
                if evaluates_without_training(self.cfg, self.start_step):
                    self.evaluate_only()
            return self.session.finish()

    def setup(self, stack: contextlib.ExitStack) -> None:
        """The user's inputs checked (`prepare`); the save dir's lock and the resume point (its config checked)
        before Ray or any role starts; then the roles, the MLflow session, the rollout engines and the stream, at the
        resume point's state, with the weights of the first step published."""
        cfg, restarts = self.cfg, self.restarts
        # every check before Ray (`relax.runner.preflight`, which dry_run=true runs too); it locks the save directory
        # into `stack` and checks the resume point
        pre = preflight(cfg, self.plan, stack=stack)
        if not pre.ok:
            raise pre.error()
        self.inputs = inputs = pre.inputs()
        self.checkpoints = checkpoints = pre.checkpoints
        if checkpoints is not None:  # a fresh start's moves: put back if the run ends before a step (StartState.ended)
            self.start.set_aside += checkpoints.set_aside
            self.start.save_dir = checkpoints.save_dir
        self.runtime.__enter__()
        self.preemption.arm()  # again: ray.init installs its own SIGTERM handler
        # the role processes start (import torch, build their models) while the driver opens its MLflow run
        self.cluster = cluster = Cluster(cfg, self.plan, inputs.info, restarts).launch()
        stack.push(cluster)  # the roles stop if opening the run fails (a second Cluster.__exit__ does nothing)
        self.session = session = stack.enter_context(Session(cfg, self.plan, self.output_dir, self.dictconfig,
                                                             checkpoints, restart_run_id=restarts.run_id,
                                                             restarts=restarts))
        stack.enter_context(cluster)  # every role answering; stopped before the session closes, as before
        if self.plan.cores:  # cluster.role_cores: where each process runs, as it says (checked against the plan)
            placed = cluster.cpu_placement()
            session.tracker.set_tags({"relax.cores." + name.replace("[", ".").rstrip("]"):
                                      f"{format_cores(p['cores'])} ({p['intra_op']} threads)"
                                      for name, p in placed.items()})
        self.engines = stack.enter_context(started_engines(cluster))  # closed before the roles stop
        restarts.run_id = session.run_id
        session.log_datasets(inputs.sampler.dataset, inputs.eval_sets)
        if tag := restarts.new_tag():
            session.tracker.set_tags(tag)
        self.start_step = session.start_step
        restarts.keep_trained_before(self.start_step)  # a restart from an earlier checkpoint drops the steps after it
        # reward_model=classifier|judge: scored in the stream's scoring thread, through its role (or its URL)
        self.reward_model = make_scorer(cfg, cluster.reward_model_call)
        if self.reward_model is not None:
            stack.callback(self.reward_model.close)
        self.stream = RolloutStream(cfg, self.engines, inputs.sampler.next_batch, start_step=self.start_step,
                                    pad_token_id=inputs.info.pad_token_id,
                                    scorer=Scorer(cfg, inputs.tokenizer, inputs.reward_fn, self.reward_model))
        if checkpoints.resume is not None:
            inputs.sampler.load_state_dict(cluster.load(checkpoints.resume.path)["sampler"])
            saved = checkpoint.read_rollout_state(checkpoints.resume.path)
            if saved is not None:
                self.stream.load_state_dict(saved, lambda d: PromptItem(**d))
        self.stream.publish(self.start_step, cluster.weights(self.start_step))
        if checkpoints.resume is not None:
            # the engines take the resumed weights now, as the interrupted run's had them by this step: a batch
            # restored from the checkpoint needs no generation, so the pump would load them only for the next one,
            # and this step's metrics would miss the update (perf/sync_bytes)
            with self.stream.paused():
                self.stream.load_newest()
        self.pace = Pace(self.stream)
        self.skipped = SkippedSteps(cfg.train.max_skipped_steps)
        self.reward_failures = FailedRewardSteps(cfg.data.max_failed_reward_steps)
        self.gate = MismatchGate(cfg.train)  # train.mismatch_gate

    def step(self, step: int) -> None:
        """One training step: the rollout (scored), rewards, advantages and optimizer steps, the weights published
        (and an evaluation), the metrics logged, a checkpoint where due."""
        cfg, cluster, session, stream = self.cfg, self.cluster, self.session, self.stream
        self.restarts.step = self.preemption.step = step
        timer = StepTimer()
        metrics: dict[str, float] = {}
        # 1. the rollout of this step, scored (generated by the stream, as far ahead as the mode allows; with
        # dynamic sampling, in as many rounds as it took to fill the batch with groups that carry a signal)
        with timer.phase("rollout"), _refusing_broken_weights(step):
            job, samples, waited = stream.take(step)
        metrics.update(staleness_metrics(samples, step, cfg.train.max_staleness))
        if job.filter is not None:
            metrics.update(filter_metrics(job.filter, len(job.items)))
            if note := filter_note(cfg, step, job.filter, len(job.items)):
                session.note(note)
        # 2. rewards; a group with a failed reward call is left out of the statistics and the loss
        scores = job.scores
        keep = kept_groups(scores.failed, cfg.rollout.n_samples_per_prompt)
        self.reward_failures.count(scores.errors, bool(keep.any()), scores.first_error)
        metrics.update(rollout_metrics(samples, torch.tensor(scores.rewards, dtype=torch.float32), keep,
                                       scores.errors))
        metrics[REWARD_TIMEOUTS] = float(scores.timeouts)
        metrics.update(count_metrics(scores))
        metrics.update(reward_model_metrics(cfg, scores.model_scores, scores.parse_failures, scores.model_time))
        # the reward trained on: the task's (rollout/raw_reward) plus DAPO's overlong penalty, when on
        rewards, penalty = trained_rewards(cfg, samples, scores)
        if penalty is not None:
            metrics.update(overlong_metrics(penalty, keep))
        trained = loss_rows(cfg, samples, keep)  # keep, less truncated responses (algorithm.mask_truncated)
        if cfg.algorithm.mask_truncated:
            metrics.update(truncated_masked_metrics(keep, trained))
        # a rollout none of whose responses counts in the loss (every group left out, or every kept response
        # truncated and masked) trains nothing: no advantages, no step
        if trained.any():
            # 3-4. the log-probs and values the algorithm needs, then advantages
            batch, advantage_metrics = train_batch(cfg, self.plan, cluster, samples, rewards, keep, step)
            metrics.update(advantage_metrics)
            gated = self.gate.check(metrics, step)  # the parity gate: True skips this rollout's optimizer steps
            # 5. optimizer steps over the global batch(es); a non-finite one is skipped and counted
            with timer.phase("train"):
                train_metrics, taken = train_on_rollout(cfg, cluster, batch, step) if not gated else ({}, 0)
            metrics.update(train_metrics)
            self.skipped.count(metrics, taken)
        # 6. weights to the rollout engines (every weight_sync_interval steps; always before evaluating)
        evaluate = bool(self.inputs.eval_sets) and evaluates_after(cfg, step)
        with timer.phase("sync"):
            if (step + 1) % cfg.train.weight_sync_interval == 0 or evaluate:
                stream.publish(step + 1, cluster.weights(step + 1))
        evaluation: dict[str, float] = {}
        eval_samples: dict[str, list[dict]] = {}
        if evaluate:  # the weights of step + 1 training steps, logged at that step (Session.log_evaluation)
            with _refusing_broken_weights(step):
                evaluation, eval_samples = _evaluate(cfg, self.engines, stream, self.inputs, self.reward_model)
        step_time = timer.elapsed()
        metrics.update(self.pace.metrics(waited, step_time))
        metrics.update(self.engines.metrics())
        metrics.update(self.restarts.metrics())
        if tag := self.restarts.new_tag():  # replicas replaced in this step
            session.tracker.set_tags(tag)
        metrics.update(timer.metrics(step_time, samples.engine_time, metrics.get(ACTOR_COMPUTE_TIME, 0.0),
                                     float(samples.response_mask.sum())))
        session.log(metrics, step, kept=bool(keep.any()), trained=bool(trained.any()))
        if evaluation:
            session.log_evaluation(evaluation, step + 1, samples=eval_samples)
        self.gate.stop_if_crossed(step)  # (train.mismatch_gate=stop) after the step's metrics, before its checkpoint
        session.record_samples(step, samples.sample_id, keep, set_aside=job.filtered_ids)
        self.skipped.check(step, metrics, self.checkpoints)  # stops before a checkpoint of this step is written
        self.reward_failures.check(step)  # (its metrics logged: rollout/reward_dropped_frac 1.0)
        self._checkpoint(step)

    def evaluate_only(self) -> None:
        """A run with no step to train (`train.num_rollout=0`, or resumed at its end): each eval set evaluated once
        with the starting weights, which `setup` published (the model's, or the resume point's), its metrics logged
        at the number of training steps in them (Session.log_evaluation: 0, or the checkpoint's step, where the
        training run logged its evaluation of the same weights). No optimizer step, no checkpoint."""
        step = self.restarts.step = self.preemption.step = self.start_step
        with _refusing_broken_weights(step):
            metrics, records = _evaluate(self.cfg, self.engines, self.stream, self.inputs, self.reward_model)
        self.session.log_evaluation(metrics, step, evaluation_only=True, samples=records)

    def _checkpoint(self, step: int) -> None:
        """The checkpoint of `step` where due: at `train.save_interval`, the last step, or a Ctrl-C / SIGTERM during
        this step (train.save_on_preempt: its checkpoint, then stop)."""
        cfg, preemption, stream = self.cfg, self.preemption, self.stream
        last = step + 1 == cfg.train.num_rollout
        interval = cfg.train.save_interval
        stop, saved = preemption.requested is not None, None
        if cfg.train.save and (last or stop or (interval and (step + 1) % interval == 0)):
            with stream.paused():  # the batches generated ahead and the one in flight go with it
                stream.save_old_logprobs(self.cluster.actor_logprobs, step + 1)
                saved = self.session.save_checkpoint(self.cluster, step + 1,
                                                     {"sampler": self.inputs.sampler.state_dict(), "step": step + 1},
                                                     rollout=stream.state_dict())
            stop = preemption.requested is not None  # also a signal during this save: it covers the step
        if stop and not last:  # (in the last step the run ends anyway, complete)
            raise preemption.stop(step, checkpointed=saved is not None)


class Pace:
    """How busy each side of the loop was: `perf/train_idle_frac` (the loop waiting for its rollout),
    `perf/rollout_idle_frac` (the engines not generating), `perf/buffer_size` (samples generated ahead)."""

    def __init__(self, stream: RolloutStream):
        self.stream = stream
        self.t, self.busy = time.perf_counter(), stream.busy_s

    def metrics(self, waited: float, step_time: float) -> dict[str, float]:
        now, busy = time.perf_counter(), self.stream.busy_s
        wall = max(now - self.t, 1e-9)
        out = {TRAIN_IDLE_FRAC: min(1.0, waited / max(step_time, 1e-9)),
               ROLLOUT_IDLE_FRAC: min(1.0, max(0.0, 1.0 - (busy - self.busy) / wall)),
               BUFFER_SIZE: float(self.stream.buffered_samples())}
        self.t, self.busy = now, busy
        return out


def evaluates_after(cfg: RelaxConfig, step: int) -> bool:
    """Whether the loop evaluates after training step `step` (0-based): every `train.eval_interval` steps and after
    the last step (`train.num_rollout`), so that a run always ends with the evaluation of its final weights."""
    interval = cfg.train.eval_interval
    return bool(interval) and ((step + 1) % interval == 0 or step + 1 == cfg.train.num_rollout)


def evaluates_without_training(cfg: RelaxConfig, start_step: int) -> bool:
    """Whether a run that starts at `start_step` evaluates once without training: it has no step left
    (`start_step >= train.num_rollout`) and evaluates: `train.num_rollout=0` (an evaluation-only run, whatever
    `train.eval_interval`), or a run resumed at its end with `train.eval_interval > 0`, whose final weights are then
    evaluated as the run's last step would have (docs/training.md, "Evaluation")."""
    return start_step >= cfg.train.num_rollout and evaluates(cfg)


def _evaluate(cfg: RelaxConfig, engines: Engines, stream: RolloutStream, inputs: Inputs,
              reward_model: Any = None) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """Each eval set's prompts with the newest weights and the eval sampling (`rollout.eval_*`), between two calls
    of the rollout stream: (its metrics, eval/<set>/... (`eval_metrics`); with `train.eval_save_samples` each set's
    sample records (`eval_sample_records`), else {}). Each eval sample has a fixed random stream, the same from one
    evaluation to the next (common random numbers); the sets share them (sample ids from 0 in each), which leaves
    each set's estimates as they are."""
    n = cfg.rollout.eval_n_samples_per_prompt
    ks = eval_pass_ks(cfg)
    eval_sets = inputs.eval_sets
    generated: dict[str, Samples] = {}
    with stream.paused():
        stream.load_newest()
        for name, items in eval_sets.items():
            prompts = [item.prompt_ids for item in items]
            generated[name] = engines.generate(prompts, sample_ids(0, len(prompts), n),
                                               seed=cfg.seed + EVAL_SEED_OFFSET, evaluation=True, items=list(items))
    out: dict[str, float] = {}
    records: dict[str, list[dict]] = {}
    threshold = cfg.train.eval_correct_threshold
    for name, items in eval_sets.items():
        scores = score(cfg, inputs.tokenizer, inputs.reward_fn, generated[name], list(items), n, reward_model)
        out.update(eval_metrics(name, generated[name], scores, n=n, pass_k=ks, threshold=threshold))
        if saves_eval_samples(cfg):
            records[name] = eval_sample_records(list(items), generated[name], scores,
                                                response_texts(inputs.tokenizer, generated[name]), n=n,
                                                threshold=threshold)
    return out, records
