"""Asynchronous training end to end on a real local Ray with the tiny model: the modes against sync, their metrics,
and the exact resume of a hybrid run."""

from __future__ import annotations

import pytest

from relax.config import load_config
from relax.metrics import (
    ABORTED_TOKENS,
    BUFFER_SIZE,
    M2_AFTER,
    M2_BEFORE,
    PARTIAL_FRAC,
    ROLLOUT_IDLE_FRAC,
    STALENESS_HIST,
    STALENESS_MAX,
    STALENESS_MEAN,
    TRAIN_IDLE_FRAC,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF,
    TRAIN_ROLLOUT_RATIO_MAX,
)
from relax.runner.train import run

pytestmark = pytest.mark.slow

SAME_DATA = ["rollout/raw_reward", "rollout/response_len", "train/loss", "train/grad_norm", "train/pg_clipfrac",
             "train/entropy"]


def test_fully_async_with_max_staleness_0_trains_on_exactly_the_sync_data(ray_local, small_run, tmp_path):
    sync = run(load_config(small_run(steps=3)), output_dir=tmp_path / "sync")
    fa = run(load_config(small_run("train.mode=fully_async", "train.max_staleness=0", steps=3)),
             output_dir=tmp_path / "async")
    assert [s for s, _ in fa.history] == [0, 1, 2]
    for (_, a), (_, b) in zip(sync.history, fa.history, strict=True):
        assert {k: a[k] for k in SAME_DATA} == {k: b[k] for k in SAME_DATA}
        assert b[STALENESS_MAX] == 0.0


def test_fully_async_m2po_with_partial_rollout_logs_staleness_and_pipelining(ray_local, small_run, tmp_path):
    cfg = load_config(small_run("algorithm=m2po", "train.mode=fully_async", "train.max_staleness=2",
                                "rollout.partial_rollout=true", "rollout.max_response_len=16", steps=5))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1, 2, 3, 4]
    for step, m in result.history:
        hist = [m[f"{STALENESS_HIST}{s}"] for s in range(3)]
        assert sum(hist) == pytest.approx(1.0) and f"{STALENESS_HIST}3" not in m
        assert 0 <= m[STALENESS_MEAN] <= m[STALENESS_MAX] <= min(2, step)
        assert 0 <= m[PARTIAL_FRAC] <= 1 and m[ABORTED_TOKENS] >= 0
        assert 0 <= m[TRAIN_IDLE_FRAC] <= 1 and 0 <= m[ROLLOUT_IDLE_FRAC] <= 1 and m[BUFFER_SIZE] >= 0
        assert TRAIN_ROLLOUT_LOGP_ABS_DIFF in m and TRAIN_ROLLOUT_RATIO_MAX in m
    stale = [m for _, m in result.history if m[STALENESS_MAX] > 0]
    assert stale, "the rollout never ran ahead of the trainer"
    # old log-probs are the generating weights': stale tokens move M2PO's second moment off zero
    assert any(m[M2_BEFORE] > 0 for m in stale) and all(m[M2_AFTER] <= m[M2_BEFORE] + 1e-12 for m in stale)


# hybrid's exact resume (equal to the uninterrupted run) is tests/runner/test_resume.py's kill -9 test
@pytest.mark.parametrize("mode", ["fully_async"])
def test_resume_of_an_asynchronous_run(mode, ray_local, small_run, tmp_path):
    """A checkpoint holds the batches generated ahead: the resumed run trains them as they were. Hybrid's versions
    do not depend on timing, so its resumed run equals the uninterrupted one; fully_async's first resumed step
    trains exactly the batch the checkpoint buffered."""
    import torch

    from relax.runner import checkpoint

    extra = ["train.mode=" + mode, "train.save_interval=2"] + (["train.max_staleness=2"] if mode == "fully_async"
                                                             else [])
    full = run(load_config(small_run(*extra, steps=4)), output_dir=tmp_path / "a")
    ckpt = tmp_path / "ckpt" / "step_000002"
    saved = checkpoint.read_rollout_state(ckpt)
    buffered = {d["step"]: d["samples"] for d in saved["buffer"]}
    assert 2 in buffered or saved["current"] is not None  # the mode generated ahead of step 2
    resumed = run(load_config(small_run(*extra, f"train.resume={ckpt}", f"train.save_dir={tmp_path}/ckpt2", steps=4)),
                  output_dir=tmp_path / "b")
    assert [s for s, _ in resumed.history] == [2, 3]
    if mode == "hybrid":
        for (_, a), (_, b) in zip(full.history[2:], resumed.history, strict=True):
            assert {k: a[k] for k in SAME_DATA} == {k: b[k] for k in SAME_DATA}
    if 2 in buffered:  # the batch of step 2 was generated before the checkpoint: trained as it was
        lengths = buffered[2]["response_mask"].sum(1).float().mean()
        assert resumed.history[0][1]["rollout/response_len"] == pytest.approx(float(lengths))
        assert torch.equal(buffered[2]["sample_id"], torch.arange(2 * 16, 3 * 16))
