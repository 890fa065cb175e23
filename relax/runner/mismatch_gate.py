"""The train/inference parity gate (`train.mismatch_gate`; docs/training.md, "Parity gate").

Each rollout's mismatch between the engine's log-probs and the trainer's, at the weights that generated it, is
measured before any optimizer step touches the rollout (with the gate on, `relax.runner.train.old_logprobs` has the
actor recompute the old log-probs, and `train_batch` reports `rollout/mismatch_k3` and
`rollout/train_rollout_logp_abs_diff` from them). When the chosen metric is above `train.mismatch_gate_bound` for
`train.mismatch_gate_steps` rollouts in a row, the gate acts: `stop` ends the run (after the step's metrics are
logged, before its checkpoint: `RunError`, exit 2, naming the metric, its value, the bound and the step); `skip`
trains nothing on each such rollout (no optimizer step; the weights and optimizer state stay as they were) and
counts it in `train/mismatch_gate_skipped`. A rollout below the bound resets the count. The count starts from zero
after a resume. A rollout without a reading of the metric (`logp_abs_diff` where every valid token was constrained
by a grammar: it reads only the free tokens, `relax.algorithms.rollout_correction.free_token_metrics`) neither
counts nor resets it, neither passes nor is skipped: it is logged as `train/mismatch_gate_unmeasured` 1.0 and a
warning, and the count goes on with the next measured rollout.
"""

from __future__ import annotations

import logging
import math

from relax.config.schema import TrainConfig
from relax.metrics import (
    MISMATCH_GATE_SKIPPED,
    MISMATCH_GATE_STREAK,
    MISMATCH_GATE_UNMEASURED,
    MISMATCH_K3,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF,
)
from relax.runner.errors import RunError, step_name

log = logging.getLogger(__name__)

GATE_METRICS = {"k3": MISMATCH_K3, "logp_abs_diff": TRAIN_ROLLOUT_LOGP_ABS_DIFF}


class MismatchGate:
    """`check` each rollout's metrics before its optimizer steps; `stop_if_crossed` after they are logged."""

    def __init__(self, train_cfg: TrainConfig) -> None:
        self.mode = train_cfg.mismatch_gate
        self.metric = GATE_METRICS[train_cfg.mismatch_gate_metric]
        self.bound = float(train_cfg.mismatch_gate_bound)
        self.steps = int(train_cfg.mismatch_gate_steps)
        self.streak = 0
        self.value = math.nan
        self.skipped = 0

    def check(self, metrics: dict[str, float], step: int) -> bool:
        """Count this rollout (its metrics as `train_batch` measured them); True: skip its optimizer steps."""
        if self.mode == "off":
            return False
        measured = self.metric in metrics
        metrics[MISMATCH_GATE_UNMEASURED] = float(not measured)
        if not measured:
            # no reading (logp_abs_diff of a rollout whose every token a grammar constrained): it is neither
            # below the bound (no reset) nor above it (no count, no skip); the count goes on with the next reading
            log.warning("%s: the train/inference parity gate has no %s for this rollout (no valid token outside "
                        "a grammar's constraint); it neither counts it nor resets its count (%d in a row)",
                        step_name(step), self.metric, self.streak)
            metrics[MISMATCH_GATE_STREAK] = float(self.streak)
            metrics[MISMATCH_GATE_SKIPPED] = 0.0
            return False
        self.value = metrics[self.metric]
        past = not (self.value <= self.bound)  # a non-finite mismatch is past any bound
        self.streak = self.streak + 1 if past else 0
        skip = self.mode == "skip" and self.streak >= self.steps
        self.skipped += int(skip)
        metrics[MISMATCH_GATE_STREAK] = float(self.streak)
        metrics[MISMATCH_GATE_SKIPPED] = float(skip)
        return skip

    def stop_if_crossed(self, step: int) -> None:
        """With `stop`: RunError once the bound was crossed `mismatch_gate_steps` rollouts in a row."""
        if self.mode != "stop" or self.streak < self.steps:
            return
        raise RunError(f"{step_name(step)}: the train/inference parity gate stopped the run: "
                       f"{self.metric}={self.value:.4g} is above train.mismatch_gate_bound={self.bound:g} for "
                       f"{self.streak} rollout(s) in a row "
                       f"(train.mismatch_gate_steps={self.steps}; train.mismatch_gate=stop). The engine's log-probs "
                       "are far from the trainer's: check model.dtype, the weight sync, and for MoE models "
                       "rollout.routing_replay.")
