"""The train/rollout mismatch where a grammar constrained some or all tokens (review diff74, B1, B2, D1).

The trainer's first-step computation (`StepSums`, micro-batch by micro-batch) and the runner's (`rollout_mismatch`,
from old log-probs) split free and constrained tokens with one helper (`constrained_split`/`free_token_sums`) and
must give the same metrics on the same data, checked here against values written by hand: the free tokens' mean
|difference| and max ratio only where there are free tokens (a step of constrained tokens only has no reading, not a
0.0 that reads as perfect parity), and k1/k3/log-ppl difference/ratio quantiles over every valid token, a micro-batch
of constrained tokens only included. The parity gate with `logp_abs_diff` leaves such a rollout unmeasured (no count,
no reset, no skip, `train/mismatch_gate_unmeasured` 1.0). `extend_responses` carries the grammar's marks of both
parts of a resumed response."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from relax.algorithms.base import AlgorithmConfig
from relax.batch import Samples, extend_responses
from relax.metrics import (
    CONSTRAINED_TOKEN_FRAC,
    MISMATCH_GATE_SKIPPED,
    MISMATCH_GATE_STREAK,
    MISMATCH_GATE_UNMEASURED,
    MISMATCH_K1,
    MISMATCH_K3,
    MISMATCH_LOG_PPL_DIFF,
    MISMATCH_RATIO_QUANTILES,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED,
    TRAIN_ROLLOUT_RATIO_MAX,
)
from relax.runner.errors import RunError
from relax.runner.mismatch_gate import MismatchGate
from relax.runner.step_metrics import rollout_mismatch
from relax.train.trainer import StepSums

OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.5, -0.3, -2.0, -1.0]])
ROLLOUT = torch.tensor([[-1.1, -1.0, -0.5, 0.0], [-1.5, -0.1, -2.2, -3.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
# the log-ratios old - rollout of the valid tokens, row by row, by hand
D = [[0.1, -1.0, 0.0], [0.0, -0.2, 0.2, 2.0]]


def quantile(values: list[float], q: float) -> float:
    """The linear-interpolation quantile, written out."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def all_token_hand() -> dict[str, float]:
    """k1, k3, log-ppl difference and ratio quantiles over all 7 valid tokens, constrained or not."""
    flat = [d for row in D for d in row]
    ratios = [math.exp(d) for d in flat]
    out = {MISMATCH_K1: sum(-d for d in flat) / 7,
           MISMATCH_K3: sum(math.exp(d) - 1 - d for d in flat) / 7,
           MISMATCH_LOG_PPL_DIFF: sum(-sum(row) / len(row) for row in D) / 2}
    for name, q in zip(MISMATCH_RATIO_QUANTILES, (0.05, 0.5, 0.95), strict=True):
        out[name] = quantile(ratios, q)
    return out


# every valid token constrained (a step of forced calls only): no free tokens' reading; |d| 3.5 over 7 constrained
ALL = (MASK, {TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED: 3.5 / 7, CONSTRAINED_TOKEN_FRAC: 1.0} | all_token_hand())
# row 0 all constrained (a micro-batch without a free token), row 1 free but its last token:
# free |d| 0 + 0.2 + 0.2 over 3, max ratio e^0.2; constrained 0.1 + 1.0 + 0 + 2.0 over 4, 4 of 7 valid
MIXED = (torch.tensor([[1, 1, 1, 0], [0, 0, 0, 1]]),
         {TRAIN_ROLLOUT_LOGP_ABS_DIFF: 0.4 / 3, TRAIN_ROLLOUT_RATIO_MAX: math.exp(0.2),
          TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED: 3.1 / 4, CONSTRAINED_TOKEN_FRAC: 4 / 7} | all_token_hand())


def trainers(constrained: torch.Tensor) -> dict[str, float]:
    """The trainer's sums over two micro-batches (a row each), as its first optimizer step adds them."""
    sums = StepSums(rollout_mismatch=True)
    for r in range(2):
        lb = SimpleNamespace(rollout_logp=ROLLOUT[r:r + 1], mask=MASK[r:r + 1].float())
        sums.add_mismatch(OLD[r:r + 1], lb, constrained[r:r + 1])
    return sums.metrics("none")


@pytest.mark.parametrize("case", [ALL, MIXED], ids=["all_constrained", "mixed"])
def test_the_trainer_and_the_runner_give_the_hand_computed_mismatch(case):
    constrained, hand = case
    runner = rollout_mismatch(AlgorithmConfig(), OLD, ROLLOUT, MASK, constrained)
    trainer = trainers(constrained)
    for out in (runner, trainer):
        assert set(out) == set(hand), sorted(set(out) ^ set(hand))
        for name, value in hand.items():
            assert out[name] == pytest.approx(value, abs=1e-6), name


def gate(**kw) -> MismatchGate:
    cfg = dict(mismatch_gate="stop", mismatch_gate_metric="logp_abs_diff", mismatch_gate_bound=0.05,
               mismatch_gate_steps=2) | kw
    return MismatchGate(SimpleNamespace(**cfg))


def test_the_gate_leaves_a_rollout_without_free_tokens_unmeasured():
    """bad, all-constrained, bad: the middle rollout neither resets the count nor adds to it, so the second bad
    rollout is the second in a row; it is logged as unmeasured."""
    g = gate()
    bad = {TRAIN_ROLLOUT_LOGP_ABS_DIFF: 0.5}
    first = dict(bad)
    assert not g.check(first, 1) and first[MISMATCH_GATE_STREAK] == 1.0 and first[MISMATCH_GATE_UNMEASURED] == 0.0
    g.stop_if_crossed(1)
    unmeasured = rollout_mismatch(AlgorithmConfig(), OLD, ROLLOUT, MASK, ALL[0])
    assert not g.check(unmeasured, 2)
    assert unmeasured[MISMATCH_GATE_UNMEASURED] == 1.0 and unmeasured[MISMATCH_GATE_STREAK] == 1.0
    assert unmeasured[MISMATCH_GATE_SKIPPED] == 0.0
    g.stop_if_crossed(2)
    third = dict(bad)
    g.check(third, 3)
    assert third[MISMATCH_GATE_STREAK] == 2.0
    with pytest.raises(RunError, match="rollout/train_rollout_logp_abs_diff=0.5 is above"):
        g.stop_if_crossed(3)


def test_the_skip_gate_trains_an_unmeasured_rollout_and_counts_past_it():
    """mismatch_gate_steps=2: bad (1 in a row), all-constrained (trained, the count stays 1), bad (2 in a row:
    skipped), good (the count reset)."""
    g = gate(mismatch_gate="skip")
    assert not g.check({TRAIN_ROLLOUT_LOGP_ABS_DIFF: 0.5}, 1)
    assert not g.check({}, 2)
    assert g.check({TRAIN_ROLLOUT_LOGP_ABS_DIFF: 0.5}, 3)
    assert not g.check({TRAIN_ROLLOUT_LOGP_ABS_DIFF: 0.01}, 4) and g.streak == 0


def part(ids: list[int], constrained) -> Samples:
    n = len(ids)
    return Samples(prompt_ids=torch.tensor([[7]]), prompt_mask=torch.tensor([[1]]),
                   response_ids=torch.tensor([ids]), response_mask=torch.ones(1, n, dtype=torch.long),
                   rollout_logp=torch.full((1, n), -0.5), finish_reason=["stop"], sample_id=torch.tensor([0]),
                   constrained=None if constrained is None else torch.tensor([constrained]))


@pytest.mark.parametrize(("prefix", "cont", "joined"), [
    ([1, 0], [0, 1, 1], [1, 0, 0, 1, 1]),
    ([1, 1], None, [1, 1, 0, 0, 0]),
    (None, [0, 0, 1], [0, 0, 0, 0, 1]),
    (None, None, None),
])
def test_extend_responses_carries_the_grammar_marks_of_both_parts(prefix, cont, joined):
    out = extend_responses(part([11, 12], prefix), part([13, 14, 15], cont))
    assert out.response_ids.tolist() == [[11, 12, 13, 14, 15]]
    assert (out.constrained is None) if joined is None else out.constrained.tolist() == [joined]


def _rank(rank: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    sums = StepSums(rollout_mismatch=True)
    lb = SimpleNamespace(rollout_logp=ROLLOUT[rank:rank + 1], mask=MASK[rank:rank + 1].float())
    sums.add_mismatch(OLD[rank:rank + 1], lb, MIXED[0][rank:rank + 1])
    sums.all_reduce(torch.distributed.group.WORLD, device=torch.device("cpu"))
    torch.save(sums.metrics("none"), f"{out}.{rank}")
    torch.distributed.destroy_process_group()


def test_two_data_parallel_ranks_give_the_mixed_steps_hand_computed_mismatch(tmp_path):
    """A data-parallel trainer (gloo, 2 ranks): rank 0 holds the row with no free token, rank 1 the other; after
    `all_reduce` both ranks' metrics are the whole step's."""
    torch.multiprocessing.spawn(_rank, args=(f"file://{tmp_path / 'init'}", str(tmp_path / "m")), nprocs=2)
    constrained, hand = MIXED
    for rank in range(2):
        out = torch.load(tmp_path / f"m.{rank}")
        assert set(out) == set(hand), sorted(set(out) ^ set(hand))
        for name, value in hand.items():
            assert out[name] == pytest.approx(value, abs=1e-6), (rank, name)
