"""The trainer core both train backends share: what one optimizer step is, whatever computes it.

A policy trainer (`Policy`: the torch backend's `relax.train.torch_policy.TorchPolicy`, the Megatron backend's
`relax.train.megatron.policy.MegatronPolicy`) implements the forward/backward of a step
(`accumulate_gradients`) and the update (`_optimizer_step`); `PolicyTrainer.train_step`, written once here, joins
them and reports the step. Also here, once: the lr schedule, micro-batching, a step's loss micro-batch by
micro-batch (`StepLoss`: the loss denominators of the step, the loss inputs of a micro-batch, `compute_loss`, the
sums a step adds up over micro-batches: loss metrics, rollout mismatch), and non-finite steps (counted, reported
and skipped: no optimizer update and no lr schedule step, so weights, optimizer state, step count and schedule
stay exactly as they were; the runner stops the run after `train.max_skipped_steps` in a row).
"""

from __future__ import annotations

import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from relax import algorithms, progress
from relax.algorithms.base import Algorithm, AlgorithmConfig, LossBatch, choices_of
from relax.algorithms.loss import ENTROPY, compute_loss
from relax.algorithms.rollout_correction import free_token_metrics, free_token_sums, log_ratios, mismatch_summary
from relax.batch import Samples, TrainBatch
from relax.config.schema import TrainConfig
from relax.metrics import (
    CRITIC_GRAD_NORM,
    CRITIC_LR,
    CRITIC_NONFINITE_GRAD_TENSORS,
    CRITIC_SKIPPED_STEPS,
    GRAD_NORM,
    LOSS,
    LR,
    NONFINITE_BATCH_VALUES,
    NONFINITE_GRAD_TENSORS,
    SKIPPED_STEPS,
)
from relax.train.packing import response_reach

logger = logging.getLogger(__name__)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which Ray and taskset set), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---- the schedule ---------------------------------------------------------------------------------------------


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for 0-based optimizer step `step`.

    Warmup: (step+1)/warmup_steps for step < warmup_steps. After it, with progress
    p = (step - warmup_steps) / max(1, total_steps - warmup_steps) clamped to [0, 1]:
    constant 1; linear 1 - (1-m) p; cosine m + (1-m) (1 + cos(pi p)) / 2, m = min_lr_ratio.
    """
    options = choices_of(TrainConfig, "lr_schedule")  # the schema's
    if schedule not in options:
        raise ValueError(f"train.lr_schedule={schedule!r}: expected one of {', '.join(options)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---- micro-batches and a step's loss over them ------------------------------------------------------------------


def micro_batches(n: int, micro_batch_size: int) -> Iterator[slice]:
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    for start in range(0, n, micro_batch_size):
        progress.tick()
        yield slice(start, min(n, start + micro_batch_size))


def length_sorted_micro_batches(samples: Samples, micro_batch_size: int, max_tokens: Optional[int] = None, *,
                                packed: bool = False) -> list[torch.Tensor]:
    """Row indices of micro-batches after sorting the rows by their real length (prompt + response), longest first.

    Each micro-batch is then trimmed to its own longest row, so rows of similar length share a micro-batch and
    little compute goes to padding. Only for per-row quantities (log-probs, losses that add over rows); the result
    equals the unsorted one up to float rounding.

    `max_tokens` (`train.max_tokens_per_micro_batch`): a micro-batch also holds at most this many tokens as the
    model computes them, padding included: its rows times its width (its longest prompt plus its longest response,
    the size of the trimmed tensors). Short rows then share a micro-batch and long ones get one of fewer rows; a row
    wider than the budget runs alone. `packed` (train.pack_sequences): the micro-batch runs without padding, so its
    tokens are the sum of its rows' (real prompt tokens + response columns used).
    """
    prompt = samples.prompt_mask.sum(-1)
    present = samples.present() != 0
    order = torch.argsort(prompt + present.sum(-1), descending=True, stable=True)
    if max_tokens is None:
        return [order[rows] for rows in micro_batches(len(order), micro_batch_size)]
    if micro_batch_size < 1 or max_tokens < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} and max_tokens={max_tokens} must be >= 1")
    reach = response_reach(samples)  # response columns each row uses
    out: list[torch.Tensor] = []
    rows: list[int] = []
    width_p = width_r = total = 0  # the open micro-batch's longest prompt and response, and its real tokens
    for i in order.tolist():
        p, r = max(width_p, int(prompt[i])), max(width_r, int(reach[i]))
        n = total + int(prompt[i]) + int(reach[i])
        cost = n if packed else (len(rows) + 1) * (p + r)  # the tokens the model would compute with row i added
        if rows and (len(rows) == micro_batch_size or cost > max_tokens):
            out.append(torch.tensor(rows, dtype=torch.long))
            rows, p, r, n = [], int(prompt[i]), int(reach[i]), int(prompt[i]) + int(reach[i])
        rows.append(i)
        width_p, width_r, total = p, r, n
    if rows:
        out.append(torch.tensor(rows, dtype=torch.long))
    return out


def step_denominators(response_mask: torch.Tensor, per_token: bool) -> tuple[float, float]:
    """(loss denominator, valid tokens) of an optimizer step: the valid tokens (per-token reduction) or the
    responses that have any (per-response reduction; a response left out of the loss has none)."""
    valid = response_mask != 0
    num_tokens = float(valid.sum())
    return (num_tokens if per_token else float(valid.any(-1).sum())), num_tokens


def entropy_mode(algo_cfg: AlgorithmConfig, report_entropy: bool) -> str:
    """How a step computes the entropy: "grad" (a loss term, entropy_coef > 0), "metric" (measured only) or "none"."""
    return "grad" if algo_cfg.entropy_coef > 0 else ("metric" if report_entropy else "none")


def loss_inputs(batch: TrainBatch, rows: Optional[torch.Tensor], logp: torch.Tensor, t: int, *,
                device: torch.device, entropy: Optional[torch.Tensor] = None,
                stats: Optional[dict[str, float]] = None) -> LossBatch:
    """The loss inputs of the micro-batch `rows` of `batch` (all rows: None), cut to its `t` response columns, on
    `device`, fp32. old_logp: the batch's, else `logp` detached (an exactly on-policy batch)."""

    def cut(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if x is None:
            return None
        return (x[:, :t] if rows is None else x[rows, :t]).to(device).float()

    old = cut(batch.old_logp) if batch.old_logp is not None else logp.detach()
    return LossBatch(logp=logp, old_logp=old, advantages=cut(batch.advantages), mask=cut(batch.response_mask),
                     ref_logp=cut(batch.ref_logp), rollout_logp=cut(batch.rollout_logp), entropy=entropy,
                     stats=stats)


class StepSums:
    """What a step adds up over its micro-batches: the loss metrics (float64, on the CPU) and, with
    `rollout_mismatch`, the free/constrained sums of |trainer log-prob - rollout log-prob| and the free tokens' max
    ratio (`relax.algorithms.rollout_correction.free_token_sums`, the split the runner's
    `relax.runner.step_metrics.rollout_mismatch` makes too: `free_token_metrics` reads them, the free tokens' metrics
    only where the step has free tokens), and the log-ratios of every valid token, constrained or not, that the
    rollout correction's mismatch diagnostics read (k1, k3, log-ppl difference, ratio quantiles:
    `relax.algorithms.rollout_correction.mismatch_summary`). A data-parallel trainer calls `all_reduce` over its ranks
    before `metrics`."""

    def __init__(self, rollout_mismatch: bool) -> None:
        self.totals: dict[str, torch.Tensor] = {}
        self.rollout_mismatch = rollout_mismatch
        # free_token_sums' layout: [sum |d| free, free tokens, sum |d| constrained, constrained tokens, max ratio free]
        self.mismatch = torch.zeros(5, dtype=torch.float64)
        # the log-ratios of the valid tokens and their per-response means (rollout_correction.log_ratios), for the
        # mismatch diagnostics; a data-parallel trainer gathers them over its ranks
        self.log_ratios: list[torch.Tensor] = []
        self.row_means: list[torch.Tensor] = []

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for name, value in metrics.items():
            value = value.detach().double().cpu()
            self.totals[name] = self.totals[name] + value if name in self.totals else value

    @torch.no_grad()
    def add_mismatch(self, logp: torch.Tensor, lb: LossBatch, constrained: Optional[torch.Tensor] = None) -> None:
        """A micro-batch's mismatch; `constrained` [B, t]: 1 on its tokens a grammar constrained (None: none)."""
        if not self.rollout_mismatch:
            return
        sums = free_token_sums(logp, lb.rollout_logp, lb.mask, constrained)
        self.mismatch[:4] += sums[:4]
        self.mismatch[4] = torch.maximum(self.mismatch[4], sums[4])
        if bool((lb.mask != 0).any()):  # every valid token, constrained or not
            tokens, rows = log_ratios(logp.float(), lb.rollout_logp, lb.mask)
            self.log_ratios.append(tokens)
            self.row_means.append(rows)

    def all_reduce(self, group: torch.distributed.ProcessGroup, *, device: torch.device) -> None:
        """The whole batch's sums on every rank of the data-parallel `group` (a collective: each of its ranks calls
        it): `totals` summed, `mismatch` [sum, max], every rank's log-ratios gathered in rank order. The tensors
        are reduced on `device`, the one the group's backend takes (CUDA for NCCL, the CPU for gloo), and come back
        to the CPU. One rank: nothing to do."""
        size = torch.distributed.get_world_size(group)
        if size == 1:
            return
        # one vector in name order, so every rank adds the same metric at the same position
        names = sorted(self.totals)
        vec = (torch.stack([self.totals[n] for n in names]) if names
               else torch.zeros(0, dtype=torch.float64)).to(device)
        torch.distributed.all_reduce(vec, group=group)
        self.totals = dict(zip(names, vec.cpu(), strict=True))
        m = self.mismatch.to(device)
        torch.distributed.all_reduce(m[:4], group=group)  # the sums and counts
        torch.distributed.all_reduce(m[4:], op=torch.distributed.ReduceOp.MAX, group=group)  # the max ratio
        self.mismatch = m.cpu()
        if self.rollout_mismatch:  # every rank's log-ratios, for the quantiles of the whole batch
            gathered: list = [None] * size
            torch.distributed.all_gather_object(gathered, (self.log_ratios, self.row_means), group=group)
            self.log_ratios = [t for tokens, _ in gathered for t in tokens]
            self.row_means = [r for _, rows in gathered for r in rows]

    def metrics(self, entropy: str) -> dict[str, float]:
        out = {name: float(value) for name, value in self.totals.items()}
        if self.rollout_mismatch:
            out.update(free_token_metrics(self.mismatch))
            if self.log_ratios:
                out.update(mismatch_summary(torch.cat(self.log_ratios), torch.cat(self.row_means)))
        if entropy == "none":
            out.pop(ENTROPY, None)
        return out


class StepLoss:
    """One optimizer step's loss, micro-batch by micro-batch, as both backends compute it.

    Settled before the micro-batches: the algorithm, the loss denominator and valid tokens of the WHOLE step
    (`step_denominators`) and how the entropy is computed (`entropy_mode`). `micro_batch` takes a micro-batch's
    log-probs to its loss: its loss inputs (`loss_inputs`), `compute_loss`, and the rollout mismatch and loss metrics
    added to the step's sums (`sums`, which a data-parallel trainer all-reduces before `metrics`).
    """

    def __init__(self, batch: TrainBatch, algo_cfg: AlgorithmConfig, *, per_token: bool, report_entropy: bool,
                 rollout_mismatch: bool) -> None:
        if batch.advantages is None:
            raise ValueError("train_step needs batch.advantages")
        self.cfg = algo_cfg
        self.algorithm: Algorithm = algorithms.get(algo_cfg.name)
        self.per_token = per_token
        self.denominator, self.num_tokens = step_denominators(batch.response_mask, per_token)
        self.entropy = entropy_mode(algo_cfg, report_entropy)
        self.sums = StepSums(rollout_mismatch)

    def micro_batch(self, batch: TrainBatch, rows: Optional[torch.Tensor], logp: torch.Tensor, t: int, *,
                    device: torch.device, entropy: Optional[torch.Tensor] = None,
                    stats: Optional[dict[str, float]] = None) -> torch.Tensor:
        """The loss of the micro-batch `rows` of `batch` (see `loss_inputs`) from its log-probs `logp` [B, t] and
        `entropy`; `stats`: the algorithm's step statistics of the whole step (M2PO), else None."""
        lb = loss_inputs(batch, rows, logp, t, device=device, entropy=entropy, stats=stats)
        constrained = None
        if batch.constrained is not None:
            constrained = (batch.constrained[:, :t] if rows is None else batch.constrained[rows, :t]).to(device)
        self.sums.add_mismatch(logp, lb, constrained)
        loss, metrics = compute_loss(self.cfg, lb, per_token=self.per_token, denominator=self.denominator,
                                     num_tokens=self.num_tokens)
        self.sums.add(metrics)
        return loss

    def add_loss(self, term: torch.Tensor) -> torch.Tensor:
        """`term` (a micro-batch's share of a loss term added outside `compute_loss`: the MoE load-balancing loss and
        router z-loss, `relax.train.routing.TrainerRouting.loss_terms`) counted in `train/loss` as `compute_loss`'s
        KL and entropy terms are, so that `train/loss` is the loss back-propagated; returns it, to be added to the
        micro-batch's loss."""
        self.sums.add({LOSS: term})
        return term

    def metrics(self) -> dict[str, float]:
        """The step's loss metrics (`StepSums.metrics`)."""
        return self.sums.metrics(self.entropy)


# ---- non-finite steps --------------------------------------------------------------------------------------------


def nonfinite_batch_values(batch: TrainBatch) -> int:
    """NaN/inf values at the valid tokens of a batch's float inputs (advantages, log-probs, returns, values)."""
    valid = batch.response_mask != 0
    tensors = (batch.advantages, batch.old_logp, batch.ref_logp, batch.rollout_logp, batch.returns, batch.old_values)
    return sum(int((~torch.isfinite(x[valid])).sum()) for x in tensors if x is not None and x.shape == valid.shape)


def nonfinite_grad_tensors(named: Iterable[tuple[str, Optional[torch.Tensor]]]) -> tuple[int, Optional[str]]:
    """(how many of the (name, gradient) pairs hold a NaN/inf, the first such name); None gradients are skipped."""
    bad = [name for name, grad in named if grad is not None and not bool(torch.isfinite(grad).all())]
    return len(bad), (bad[0] if bad else None)


@dataclass(frozen=True)
class StepOutcome:
    """One optimizer step as taken: the gradient norm before clipping, the lr it used, and whether it was skipped
    (then the non-finite counts: parameter tensors with a NaN/inf gradient, NaN/inf values in the batch)."""

    grad_norm: float
    lr: float
    skipped: bool = False
    grad_tensors: int = 0
    batch_values: int = 0


@dataclass(frozen=True)
class StepKeys:
    """The metric names under which a trainer reports its optimizer step."""

    grad_norm: str
    lr: str
    skipped: str
    grad_tensors: str


POLICY_STEP = StepKeys(GRAD_NORM, LR, SKIPPED_STEPS, NONFINITE_GRAD_TENSORS)
CRITIC_STEP = StepKeys(CRITIC_GRAD_NORM, CRITIC_LR, CRITIC_SKIPPED_STEPS, CRITIC_NONFINITE_GRAD_TENSORS)


def with_step(metrics: dict[str, float], outcome: StepOutcome, keys: StepKeys) -> dict[str, float]:
    """`metrics` of a step's forward/backward with its optimizer step's (the non-finite counts only on a skip)."""
    metrics[keys.grad_norm] = outcome.grad_norm
    metrics[keys.lr] = outcome.lr
    metrics[keys.skipped] = float(outcome.skipped)
    if outcome.skipped:
        metrics[keys.grad_tensors] = float(outcome.grad_tensors)
        metrics[NONFINITE_BATCH_VALUES] = float(outcome.batch_values)
    return metrics


class SkippedInARow:
    """Optimizer steps a trainer skipped since its last applied one, and the warning of each skip."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.count = 0

    def applied(self, grad_norm: float, lr: float) -> StepOutcome:
        self.count = 0
        return StepOutcome(grad_norm, lr)

    def skipped(self, *, applied: int, loss: float, grad_norm: float, lr: float, bad_grads: int,
                first_bad: Optional[str], batch: TrainBatch, log: bool = True) -> StepOutcome:
        """A skipped step (`applied` steps so far); `log`: this process writes the warning (one rank of several)."""
        self.count += 1
        values = nonfinite_batch_values(batch)
        if log:
            where = f" (first: {first_bad})" if first_bad else ""
            logger.warning(f"{self.who}: optimizer step skipped ({self.count} in a row, {applied} applied so far), "
                           f"weights and optimizer state unchanged: loss={loss}, grad_norm={grad_norm}; non-finite "
                           f"gradients in {bad_grads} parameter tensor(s){where}; {values} non-finite value(s) in "
                           "the batch")
        return StepOutcome(grad_norm, lr, skipped=True, grad_tensors=bad_grads, batch_values=values)


# ---- the policy trainer --------------------------------------------------------------------------------------------


class Policy(Protocol):
    """A policy trainer, as the actor role drives it (both backends; every rank of a parallel trainer calls the same
    methods with the same arguments). Inputs and outputs are CPU tensors."""

    @property
    def step(self) -> int:
        """Optimizer steps applied (restored by `load_checkpoint`)."""

    def compute_logprobs(self, samples: Samples, micro_batch_size: int,
                         max_tokens: Optional[int] = None) -> torch.Tensor:
        """log p(response tokens) under the current weights, [N, T] fp32, 0 where masked (micro-batches of at most
        `micro_batch_size` rows and `max_tokens` tokens, see `length_sorted_micro_batches`)."""

    def train_step(self, batch: TrainBatch, algo_cfg: AlgorithmConfig, *, per_token: bool, micro_batch_size: int,
                   max_tokens: Optional[int] = None, report_entropy: bool = True,
                   rollout_mismatch: bool = False) -> dict[str, float]:
        """One optimizer step over `batch` (see `PolicyTrainer.train_step`)."""

    def state_dict_for_rollout(self, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
        """The current weights keyed like the HF model's state_dict, for the rollout engines."""

    def save_checkpoint(self, directory: str | os.PathLike) -> None: ...

    def load_checkpoint(self, directory: str | os.PathLike, *, load_optimizer: bool = True) -> None: ...


class PolicyTrainer(ABC):
    """`train_step`, once for both backends: the backend's forward/backward, then its optimizer step."""

    @abstractmethod
    def accumulate_gradients(self, batch: TrainBatch, algo_cfg: AlgorithmConfig, *, per_token: bool,
                             micro_batch_size: int, max_tokens: Optional[int] = None, report_entropy: bool = True,
                             rollout_mismatch: bool = False) -> dict[str, float]:
        """Fresh gradients of the whole batch's loss; the step's loss metrics (`StepSums.metrics`)."""

    @abstractmethod
    def _optimizer_step(self, loss: float, batch: TrainBatch) -> StepOutcome:
        """Clip and apply the gradients, unless the loss or the gradient norm is not finite (then skip)."""

    def train_step(self, batch: TrainBatch, algo_cfg: AlgorithmConfig, *, per_token: bool, micro_batch_size: int,
                   max_tokens: Optional[int] = None, report_entropy: bool = True,
                   rollout_mismatch: bool = False) -> dict[str, float]:
        """One optimizer step over `batch` (gradient accumulation over micro-batches of at most `micro_batch_size`
        rows and `max_tokens` tokens, see `length_sorted_micro_batches`).

        `rollout_mismatch`: the weights are those that generated the batch (the first optimizer step of a
        synchronous rollout): report `rollout/train_rollout_logp_abs_diff` (mean |trainer log-prob - rollout
        log-prob| over valid tokens) and `rollout/train_rollout_ratio_max` (max exp(trainer - rollout)) from the
        log-probs this step computes anyway.

        old_logp: `batch.old_logp` (the runner's `old_logprobs` decides what it is), else the current log-probs
        detached (an exactly on-policy batch). Entropy gets a gradient only when `entropy_coef > 0`; otherwise it
        is only measured (`report_entropy`). Returns the metrics of `compute_loss` summed over micro-batches (losses
        reduced as configured, diagnostics as means over the valid tokens of the whole step; see
        `relax.algorithms.compute_loss`) plus `train/grad_norm` (before clipping), `train/lr` (the lr this step
        used) and `train/skipped_steps` (1 when the loss or the gradient norm was not finite and the step was
        skipped, see the module docstring; then also `train/nonfinite_grad_tensors` and
        `train/nonfinite_batch_values`).
        """
        out = self.accumulate_gradients(batch, algo_cfg, per_token=per_token, micro_batch_size=micro_batch_size,
                                        max_tokens=max_tokens, report_entropy=report_entropy,
                                        rollout_mismatch=rollout_mismatch)
        return with_step(out, self._optimizer_step(out.get(LOSS, 0.0), batch), POLICY_STEP)
