"""model=tiny_moe fully_async with partial rollout and routing replay through the training loop (roles in this
process): generations interrupted by a weight update (a barrier, tests/runner/test_async_training.py's hook) are
continued under the new weights, and the trainer replays every trained token's recorded experts (router agreement 1
on every step). What the joined routes hold, token by token: tests/models/test_moe_partial.py."""

from __future__ import annotations

import pytest
from test_async_training import ONE_THREAD, updates_during_generation

from relax.config import load_config
from relax.metrics import PARTIAL_FRAC
from relax.models.moe import recorded_mask
from relax.runner.train import run

pytestmark = pytest.mark.slow


def test_tiny_moe_trains_fully_async_with_partial_rollout_and_replay(in_process, small_run, tmp_path, monkeypatch,
                                                                    trained_batches):
    updates_during_generation(monkeypatch, {2: 1})  # job 1's first call is interrupted by version 1
    cfg = load_config(small_run(ONE_THREAD, "model=tiny_moe", "model.dtype=float32", "rollout.routing_replay=true",
                                "train.mode=fully_async", "train.max_staleness=2", "rollout.partial_rollout=true",
                                "rollout.max_response_len=12", steps=4))
    result = run(cfg, output_dir=tmp_path / "out")
    assert result.series("rollout/router_agreement") == [1.0] * 4
    assert any(f > 0 for f in result.series(PARTIAL_FRAC)), "no response was interrupted and continued"
    spans = 0
    for samples in trained_batches.values():
        assert "abort" not in samples.finish_reason
        versions = samples.versions()
        spans += int(sum(len(set(v[m.bool()].tolist())) > 1 for v, m in zip(versions, samples.response_mask,
                                                                             strict=True)))
        # every token the engine fed has its experts (all but each row's last): none lost in the join
        P = samples.prompt_ids.shape[1]
        known = recorded_mask(samples.routed_experts, cfg.model.num_experts).all(-1)[:, P:]
        lengths = samples.response_mask.sum(1)
        for row, n in enumerate(lengths.tolist()):
            assert bool(known[row, :n - 1].all()) and not bool(known[row, n - 1:].any())
    assert spans > 0  # responses whose tokens two weight versions generated
