"""The optimizer steps of one rollout: which global batches train, who trains on them, how their metrics combine,
and the counts of steps that train nothing and stop a run: skipped (non-finite) optimizer steps, and rollouts whose
every group failed its rewards.

A rollout's batch is `train.num_steps_per_rollout` consecutive global batches of `train.global_batch_size` rows
(with `train.use_dynamic_global_batch_size`, of equal shares of the rollout's response tokens instead: a global
batch then follows the tokens produced, more short responses or fewer long ones); each global batch with a valid
token is one optimizer step of the actor (and of PPO's critic, which trains alone on its warm-up steps); one without
any takes no step (Adam would still move). The roles train through `Cluster.train_step`; everything decided here is
the recipe's, not the cluster's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax import algorithms
from relax.batch import TrainBatch
from relax.config.schema import RelaxConfig
from relax.metrics import (
    ACTOR_COMPUTE_TIME,
    CRITIC_GRAD_NORM,
    CRITIC_ONLY,
    CRITIC_SKIPPED_STEPS,
    GRAD_NORM,
    LOSS,
    MOE_EXPERT_BIAS_MAX,
    MOE_EXPERT_BIAS_MIN,
    SKIPPED_STEPS,
    VALUE_LOSS,
)
from relax.runner import checkpoint
from relax.runner.branch_rows import global_batch_rows, run_starts
from relax.runner.errors import RunError, step_name

if TYPE_CHECKING:
    from relax.runner.cluster import Cluster

# how a rollout's metric comes from those of its optimizer steps (this is the one place that decides it): times and
# skipped-step counts add up; a state the steps leave behind (the routers' selection bias after its update) is the
# last step's that reports it (a skipped step updates nothing and reports none); other metrics average
SUMMED = frozenset({ACTOR_COMPUTE_TIME, SKIPPED_STEPS, CRITIC_SKIPPED_STEPS})
LAST = frozenset({MOE_EXPERT_BIAS_MAX, MOE_EXPERT_BIAS_MIN})


def global_batches(cfg: RelaxConfig, batch: TrainBatch) -> list[tuple[int, TrainBatch]]:
    """(k, the k-th global batch) of a rollout's batch, for those with a valid token (the optimizer steps it takes):
    a global batch whose groups were all left out, or whose responses were all truncated and masked, takes none."""
    t = cfg.train
    # rows of one agent run that forked (relax.runner.branch_rows) share its sample id and stay in one global batch,
    # whose size counts runs
    starts = run_starts(batch.sample_id)
    tokens = batch.response_mask.sum(-1).tolist()
    if starts is not None:
        tokens = [sum(tokens[a:b]) for a, b in zip(starts, starts[1:] + [len(batch)], strict=True)]
    bounds = bounds_of_tokens(tokens, t.num_steps_per_rollout) if t.use_dynamic_global_batch_size else \
        [k * t.global_batch_size for k in range(t.num_steps_per_rollout + 1)]
    bounds = global_batch_rows(bounds, starts, len(batch))
    chunks = ((k, batch.select(slice(bounds[k], bounds[k + 1]))) for k in range(t.num_steps_per_rollout))
    return [(k, chunk) for k, chunk in chunks if bool(chunk.response_mask.any())]


def token_bounds(batch: TrainBatch, steps: int) -> list[int]:
    """Row boundaries of `steps` consecutive global batches with equal shares of the batch's response tokens: the
    k-th ends at the first row where the running token count reaches k/steps of the total (every global batch
    keeps at least one row)."""
    return bounds_of_tokens(batch.response_mask.sum(-1).tolist(), steps)


def bounds_of_tokens(tokens: list[int], steps: int) -> list[int]:
    """`token_bounds` of rows holding `tokens` response tokens each."""
    total, n = sum(tokens), len(tokens)
    bounds, running, row = [0], 0, 0
    for k in range(1, steps):
        while row < n - (steps - k) and (row < bounds[-1] + 1 or running * steps < k * total):
            running += tokens[row]
            row += 1
        bounds.append(row)
    return bounds + [n]


def average_over_steps(metrics: list[dict[str, float]]) -> dict[str, float]:
    """One rollout's metrics from those of its optimizer steps: `SUMMED` keys add up, `LAST` keys are the last
    step's that reports them, the others average over the steps that report them."""
    keys = {k for m in metrics for k in m}
    return {k: [m[k] for m in metrics if k in m][-1] if k in LAST
            else sum(m[k] for m in metrics if k in m) / (1 if k in SUMMED else sum(1 for m in metrics if k in m))
            for k in keys}


def train_on_rollout(cfg: RelaxConfig, cluster: Cluster, batch: TrainBatch, step: int) -> tuple[dict[str, float], int]:
    """The optimizer steps of rollout `step` on its batch: (the rollout's train metrics, how many steps were taken).

    The actor trains unless this is one of the algorithm's critic-only warm-up steps (PPO); a critic, where the plan
    has one, trains on every step. The first optimizer step of an on-policy batch without old log-probs runs at the
    weights that generated it: it measures the train/rollout mismatch (otherwise the runner does, from old_logp)."""
    critic_only = step < algorithms.get(cfg.algorithm.name).critic_only_steps(cfg.algorithm)
    steps = global_batches(cfg, batch)
    out = average_over_steps([cluster.train_step(chunk, actor=not critic_only,
                                                 rollout_mismatch=k == 0 and batch.old_logp is None)
                              for k, chunk in steps])
    if critic_only:
        out[CRITIC_ONLY] = 1.0
    return out, len(steps)


class SkippedSteps:
    """Optimizer steps the trainers skipped (their loss or gradient norm was not finite; weights, optimizer state and
    lr schedule stay as they were), counted per rollout and in a row: `train.max_skipped_steps` in a row stop the run.

    A trainer reports 0/1 per optimizer step and `average_over_steps` sums them over the rollout's steps. In a partly
    skipped rollout the skipped steps are taken to be its last ones (a diverged trainer keeps failing), so a run
    with several optimizer steps per rollout may stop up to that many steps early.
    """

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def count(self, metrics: dict[str, float], steps: int) -> None:
        """Add this rollout's skipped optimizer steps (of its `steps`) to the run of skips in a row."""
        skipped = 0
        for key in (SKIPPED_STEPS, CRITIC_SKIPPED_STEPS):  # the policy's and the critic's (PPO) optimizer
            if key in metrics:
                skipped = max(skipped, int(metrics[key]))
        self.in_a_row = self.in_a_row + skipped if skipped == steps else skipped

    def check(self, step: int, metrics: dict[str, float], checkpoints: checkpoint.Checkpoints) -> None:
        """Raise RunError once `train.max_skipped_steps` optimizer steps in a row were skipped."""
        if self.in_a_row < self.limit:
            return
        values = ", ".join(f"{k}={metrics[k]:g}" for k in (LOSS, GRAD_NORM, VALUE_LOSS, CRITIC_GRAD_NORM)
                           if k in metrics)
        last = checkpoint.latest(checkpoints.save_dir) if checkpoints.uses_dir else None
        kept = f"the last checkpoint is {last}" if last is not None else "no checkpoint was committed before it"
        raise RunError(f"{step_name(step)}: {self.in_a_row} optimizer step(s) in a row were skipped because the loss "
                       f"or the gradient norm is not finite ({values}); train.max_skipped_steps={self.limit}. The "
                       f"weights are those of the last applied step; {kept}. Lower train.lr or check the rewards.")


class FailedRewardSteps:
    """Steps in which failed reward calls (or failed episodes: an agent program that raised, an environment past
    data.env_timeout_s) left every group out (`data.reward_error=drop_group`), so that nothing was
    trained, counted in a row: `data.max_failed_reward_steps` in a row stop the run, naming the first failure. A
    reward that fails every call (a signature or label it cannot take, a service refusing the key) would otherwise
    run to the end training nothing and exit 0, its only trace `rollout/reward_dropped_frac` 1.0."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row, self.first_error = limit, 0, None

    def count(self, errors: int, kept: bool, first_error: str | None) -> None:
        """One step's reward failures (`errors` failed calls), and whether any group was kept."""
        if errors and not kept:
            self.in_a_row += 1
            self.first_error = self.first_error or first_error
        else:
            self.in_a_row, self.first_error = 0, None

    def check(self, step: int) -> None:
        """Raise RunError once `data.max_failed_reward_steps` steps in a row trained nothing for failed rewards."""
        if not self.limit or self.in_a_row < self.limit:
            return
        lines = [line for line in (self.first_error or "").strip().splitlines() if line.strip()]
        why = f"; the first failure: {lines[-1].strip()}" if lines else ""
        source = failure_source(self.first_error)
        if source is None:  # a data.reward call's (or the reward model's)
            failed, advice = "its reward calls failed", ("Check data.reward (its signature, the labels it reads, the "
                                                         "service it calls) and the reward model")
        else:  # an episode's: the agent program, agent loop or environment named with its value
            failed = "its agent runs failed" if source == "data.openai_agent" else "its episodes failed"
            advice = f"Check {self.first_error.lstrip().split(': ', 1)[0]} (run it by hand on one prompt item)"
        raise RunError(f"{step_name(step)}: in {self.in_a_row} step(s) in a row every group was left out because "
                       f"{failed}, so nothing was trained (data.max_failed_reward_steps={self.limit}){why}. "
                       f"{advice}; the warnings above name each step's first failure.")


def failure_source(first_error: str | None) -> str | None:
    """The episode option a step's first failure came from ("data.openai_agent", "data.agent", "data.env",
    "data.tools"), by the prefix `relax.runner.rollout_driver.scoring` gives it; None for a data.reward call's or the
    reward model's."""
    head = (first_error or "").lstrip().split(": ", 1)[0]
    option = head.split("=", 1)[0]
    return option if "=" in head and option in ("data.openai_agent", "data.agent", "data.env", "data.tools") else None
