"""Agentic training end to end with the tiny model on data=guess_number: every mode (partial rollout across turns
included), the trainer's log-probs against the engine's at the generating weights, per-token versions and staleness,
and the exact resume of a checkpoint that holds episodes generated ahead and in flight. (kill -9 and resume=auto of an
agentic run on a real Ray: tests/runner/test_resume.py.)"""

from __future__ import annotations

import pytest
import torch
from runner.test_async_training import ONE_THREAD, SAME_DATA, updates_during_generation

from relax.batch import Samples
from relax.config import load_config
from relax.metrics import (
    OBS_TOKEN_FRAC,
    PARTIAL_FRAC,
    STALENESS_MAX,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF,
    TURNS_MEAN,
)
from relax.runner.train import run

pytestmark = pytest.mark.slow

AGENTIC = ["data=guess_number", "rollout.max_turns=3", "rollout.max_episode_tokens=40", ONE_THREAD]
MODES = {
    # TIS: the old log-probs are recomputed (the mismatch); evaluation at the end, on episodes too
    "sync": ["train.mode=sync", "algorithm.use_tis=true", "train.eval_interval=3", "data.num_eval_prompts=8"],
    "hybrid": ["train.mode=hybrid"],
    "fully_async_partial": ["train.mode=fully_async", "train.max_staleness=2", "rollout.partial_rollout=true",
                            "algorithm=m2po"],
}


def check_episodes(samples: Samples, step: int, staleness: int, max_turns: int = 3) -> None:
    """What a trained agentic batch must hold: finished episodes, observations out of the loss mask but in the
    context, per-token versions within the staleness bound."""
    assert samples.episodes is not None and "abort" not in samples.finish_reason
    gen, present = samples.response_mask.bool(), samples.present().bool()
    assert (gen <= present).all() and (samples.obs_mask().bool() == (present & ~gen)).all()
    for r, e in enumerate(samples.episodes):  # each model turn is a run of generated tokens
        runs = int(((gen[r, 1:] & ~gen[r, :-1]).sum()) + gen[r, 0])
        assert runs == e["turns"] == len(e["actions"]) <= max_turns
    versions = samples.versions()[gen]
    assert int(versions.min()) >= step - staleness and int(versions.max()) <= step


@pytest.mark.parametrize("mode", list(MODES))
def test_guess_number_trains_in_every_mode(mode, in_process, small_run, tmp_path, monkeypatch, trained_batches):
    if mode == "fully_async_partial":
        updates_during_generation(monkeypatch, {2: 1})  # the first weight update finds job 1's episodes in flight
    staleness = 2 if mode == "fully_async_partial" else (1 if mode == "hybrid" else 0)
    result = run(load_config(small_run(*AGENTIC, *MODES[mode], steps=3)), output_dir=tmp_path / "out")
    evaluation = result.history.pop()[1] if mode == "sync" else None  # at step 3: the weights of 3 steps
    assert [s for s, _ in result.history] == [0, 1, 2]
    for step, m in result.history:
        assert 1 <= m[TURNS_MEAN] <= 3 and 0 < m[OBS_TOKEN_FRAC] < 1
        assert m.get(STALENESS_MAX, 0) <= staleness
        check_episodes(trained_batches[step], step, staleness)
    if mode == "fully_async_partial":
        assert any(m[PARTIAL_FRAC] > 0 for _, m in result.history), "no episode was interrupted and continued"
    if mode == "sync":  # greedy eval episodes, scored by the environment: a reward it can give (0 or a find)
        assert 0 <= evaluation["eval/guess_number/mean_at_1"] <= 1 and evaluation["eval/guess_number/response_len"] > 0
    diffs = [m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] for _, m in result.history if TRAIN_ROLLOUT_LOGP_ABS_DIFF in m]
    assert diffs, "the trainer never recomputed the old log-probs"
    # the trainer against the engine, at the generating weights: the single-turn run's level
    trained_batches.clear()
    single = run(load_config(small_run(ONE_THREAD, *MODES[mode], "rollout.max_response_len=12", steps=3)),
                 output_dir=tmp_path / "single")
    level = max(m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] for _, m in single.history if TRAIN_ROLLOUT_LOGP_ABS_DIFF in m)
    assert max(diffs) <= 3 * level + 1e-6, (diffs, level)


def test_resume_of_an_agentic_run_with_episodes_ahead_and_in_flight(in_process, small_run, tmp_path,
                                                                    trained_batches):
    """A fully_async checkpoint holds the episodes generated ahead (and the job in flight with its unfinished
    episodes): the resumed run trains them as they were, the first resumed step exactly the batch the checkpoint
    buffered, equal to the uninterrupted run's."""
    from relax.runner import checkpoint
    extra = [*AGENTIC, "train.mode=fully_async", "train.max_staleness=2", "train.save_interval=2"]
    full = run(load_config(small_run(*extra, steps=4)), output_dir=tmp_path / "a")
    uninterrupted = dict(trained_batches)
    ckpt = tmp_path / "ckpt" / "step_000002"
    saved = checkpoint.read_rollout_state(ckpt)
    buffered = {d["step"]: Samples(**d["samples"]) for d in saved["buffer"]}
    assert 2 in buffered and buffered[2].episodes is not None, sorted(buffered)
    trained_batches.clear()
    resumed = run(load_config(small_run(*extra, f"train.resume={ckpt}", f"train.save_dir={tmp_path}/ckpt2", steps=4)),
                  output_dir=tmp_path / "b")
    assert [s for s, _ in resumed.history] == [2, 3]
    for name in ("sample_id", "response_ids", "response_mask", "token_mask", "token_version", "rollout_logp"):
        assert torch.equal(getattr(trained_batches[2], name), getattr(buffered[2], name)), name
        assert torch.equal(getattr(trained_batches[2], name), getattr(uninterrupted[2], name)), name
    assert trained_batches[2].episodes == uninterrupted[2].episodes
    (_, a), (_, b) = full.history[2], resumed.history[0]
    assert {k: a[k] for k in SAME_DATA} == {k: b[k] for k in SAME_DATA}


def test_guess_number_over_sglang_with_partial_rollout(in_process, small_run, tmp_path, trained_batches,
                                                       monkeypatch):
    """rollout=sglang (two embedded servers behind the real sglang-router, real HTTP): a `/generate` request per turn
    with the episode's tokens as input_ids; weight updates abort episodes mid-turn or between turns, which continue
    with the new weights; the trainer's log-probs equal the servers' for every generated token of every turn (fp32),
    and the ledger verifies (no episode lost or trained twice). The servers and the router are processes of their
    own; the roles that drive them run in this process (`in_process`): what this test is about is the HTTP
    protocol and the episodes, not Ray (the same servers as Ray actors: tests/runner/test_sglang_training.py)."""
    from runner.test_sglang_training import SGLANG, update_mid_generation

    from relax.cli.verify_run import verify

    update_mid_generation(monkeypatch)  # version 1 interrupts the episodes of a job in flight, mid-turn

    cfg = load_config(small_run(*SGLANG, *AGENTIC, "model.dtype=float32", "algorithm=m2po", "train.mode=fully_async",
                                "train.max_staleness=2", "rollout.partial_rollout=true",
                                "rollout.max_turns=5", "rollout.max_response_len=4", "rollout.max_episode_tokens=80",
                                steps=3))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1, 2]
    for step, m in result.history:
        assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < 1e-4 and 1 <= m[TURNS_MEAN] <= 5
        check_episodes(trained_batches[step], step, 2, max_turns=5)
    interrupted = 0  # episodes whose tokens come from two weight versions
    for s in trained_batches.values():
        versions, gen = s.versions(), s.response_mask.bool()
        interrupted += sum(int(versions[r][gen[r]].unique().numel() > 1) for r in range(len(s)))
    assert interrupted > 0 and sum(m[PARTIAL_FRAC] for _, m in result.history) > 0
    report = verify(result.run_id, cfg.tracking.uri)
    assert report.ok, report.text()
