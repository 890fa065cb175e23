"""Asynchronous training end to end with the tiny model: the modes against sync, staleness and partial rollout, and
the exact resume of the batches generated ahead.

The staleness bound and partial rollout run on a real local Ray (the rollout and the actor in processes of their
own, as a run has them); the same run proves cluster.role_cores end to end (each role's process on its core, read
from /proc by this test). The comparisons between runs and the algorithm matrix run the same loop with the roles in
this process (`in_process`), with one torch thread everywhere so that two runs compute the same floats."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from relax.batch import Samples
from relax.config import load_config
from relax.config.core_rules import parse_cores
from relax.metrics import (
    ABORTED_TOKENS,
    BUFFER_SIZE,
    LOSS,
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
from relax.runner.cluster import Cluster
from relax.runner.rollout_driver import stream as rollout_stream
from relax.runner.train import run

pytestmark = pytest.mark.slow

SAME_DATA = ["rollout/raw_reward", "rollout/response_len", "train/loss", "train/grad_norm", "train/pg_clipfrac",
             "train/entropy"]
ONE_THREAD = "cluster.cpus_per_node=1"  # the same torch thread count in every mode: the same floats


BARRIER_WAIT_S = 120.0  # a barrier never reached ends its wait (the test then fails on what it checks)


def updates_during_generation(monkeypatch, versions: dict[int, int]) -> None:
    """Weight updates land inside generations by construction (roles in this process, one rollout engine): for each
    (call c: version v) of `versions`, the engine's c-th generation call (1-based, in the order the pump makes them)
    stops after its first token until the stream's `publish` of version v has returned, and that publish waits until
    the generation got there. So the publish finds the generation in flight: with partial rollout it interrupts it
    (the generation continues to its next token and stops), with staged weights the copy starts beside it. A call
    that waits for a publish must not be one that the publish depends on: version v follows the training of step
    v - 1, which needs every job before job v finished."""
    import threading

    from relax.roles.workers import RolloutWorker
    from relax.runner.rollout_driver.stream import RolloutStream

    reached = {v: threading.Event() for v in versions.values()}
    published = {v: threading.Event() for v in versions.values()}
    calls = [0]
    should_abort, publish = RolloutWorker._should_abort, RolloutStream.publish

    def held(self, gen_id):
        check = should_abort(self, gen_id)
        calls[0] += 1
        version = versions.get(calls[0])
        if version is None:
            return check
        tokens = [0]

        def should_abort_now() -> bool:
            tokens[0] += 1
            if tokens[0] == 1:
                reached[version].set()
                published[version].wait(BARRIER_WAIT_S)
            return check is not None and check()

        return should_abort_now

    def publish_in_flight(self, version, weights):
        if version in reached:
            reached[version].wait(BARRIER_WAIT_S)
        publish(self, version, weights)
        if version in published:
            published[version].set()

    monkeypatch.setattr(RolloutWorker, "_should_abort", held)
    monkeypatch.setattr(RolloutStream, "publish", publish_in_flight)


def check_staleness(result, bound: int) -> None:
    for step, m in result.history:
        hist = [m[f"{STALENESS_HIST}{s}"] for s in range(bound + 1)]
        assert sum(hist) == pytest.approx(1.0) and f"{STALENESS_HIST}{bound + 1}" not in m
        assert 0 <= m[STALENESS_MEAN] <= m[STALENESS_MAX] <= min(bound, step), (step, m[STALENESS_MAX])


def test_fully_async_with_max_staleness_0_trains_on_exactly_the_sync_data(in_process, small_run, tmp_path):
    sync = run(load_config(small_run(ONE_THREAD, steps=3)), output_dir=tmp_path / "sync")
    fa = run(load_config(small_run(ONE_THREAD, "train.mode=fully_async", "train.max_staleness=0", steps=3)),
             output_dir=tmp_path / "async")
    assert [s for s, _ in fa.history] == [0, 1, 2]
    for (_, a), (_, b) in zip(sync.history, fa.history, strict=True):
        assert {k: a[k] for k in SAME_DATA} == {k: b[k] for k in SAME_DATA}
        assert b[STALENESS_MAX] == 0.0


def allowed_cores(pid: int) -> set[tuple[int, ...]]:
    """The distinct Cpus_allowed_list of every thread of process `pid`, as the kernel reports them."""
    masks = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended between the listing and the reading
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                masks.add(parse_cores(line.split(":", 1)[1]))
    return masks


def test_fully_async_m2po_with_partial_rollout_logs_staleness_and_pipelining(ray_local, small_run, tmp_path,
                                                                              monkeypatch):
    """Also cluster.role_cores end to end, where this process may use cores 0 and 1: the rollout on core 0, the
    actor on core 1. While the roles run (when the runner asks them where they are), this test reads every thread's
    allowed cores of each role process from /proc itself (not from what the roles report), and the thread counts
    each process reports; the test's own process, which is not pinned, is the control that the same reading sees
    every core. Pinning a process without and with the variable: tests/config/test_role_cores.py. Without those
    cores the async claims are checked and the pinning is reported skipped."""
    pinned = {0, 1} <= os.sched_getaffinity(0)
    seen: dict[str, tuple[dict, set]] = {}
    placement = Cluster.cpu_placement

    def read_while_running(self):
        placed = placement(self)
        for name, p in placed.items():
            seen[name] = (p, allowed_cores(p["pid"]))
        return placed

    monkeypatch.setattr(Cluster, "cpu_placement", read_while_running)
    # weights staged beside generation (rollout.stage_weights, the GPU default) in real Ray engine processes
    cfg = load_config(small_run("algorithm=m2po", "train.mode=fully_async", "train.max_staleness=2",
                                "rollout.partial_rollout=true", "rollout.max_response_len=16",
                                "rollout.stage_weights=true",
                                *(["+cluster.role_cores={rollout: '0', actor: '1'}"] if pinned else []), steps=5))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1, 2, 3, 4]
    check_staleness(result, 2)
    for _, m in result.history:
        assert 0 <= m[PARTIAL_FRAC] <= 1 and m[ABORTED_TOKENS] >= 0
        assert 0 <= m[TRAIN_IDLE_FRAC] <= 1 and 0 <= m[ROLLOUT_IDLE_FRAC] <= 1 and m[BUFFER_SIZE] >= 0
        assert TRAIN_ROLLOUT_LOGP_ABS_DIFF in m and TRAIN_ROLLOUT_RATIO_MAX in m
    stale = [m for _, m in result.history if m[STALENESS_MAX] > 0]
    assert stale, "the rollout never ran ahead of the trainer"
    # old log-probs are the generating weights': stale tokens move M2PO's second moment off zero
    assert any(m[M2_BEFORE] > 0 for m in stale) and all(m[M2_AFTER] <= m[M2_BEFORE] + 1e-12 for m in stale)

    if not pinned:
        pytest.skip("the async claims passed; cluster.role_cores not checked: needs cores 0 and 1")
    assert set(seen) == {"actor", "rollout"}
    for name, core in (("rollout", 0), ("actor", 1)):
        reported, kernel = seen[name]
        assert kernel == {(core,)}, f"{name}: threads allowed on {kernel}"
        assert reported["pid"] != os.getpid()
        assert (reported["intra_op"], reported["inter_op"]) == (1, 1)
    assert seen["actor"][0]["pid"] != seen["rollout"][0]["pid"]
    # control: the same reading of this process (not pinned) sees all of its cores, two at least
    assert allowed_cores(os.getpid()) == {tuple(sorted(os.sched_getaffinity(0)))}
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(result.run_id).data.tags
    assert tags["relax.cores.rollout"] == "0 (1 threads)" and tags["relax.cores.actor"] == "1 (1 threads)"


def test_staged_weights_change_nothing_but_when_the_copy_happens(in_process, small_run, tmp_path, monkeypatch):
    """rollout.stage_weights (the GPU default): in hybrid mode, where every batch's weights are fixed by its step,
    the run whose engine copies each version while it generates (each publish made to land during a generation) and
    swaps it in trains on exactly the data of the run that copies at load time. Swaps happened (a
    swap of the wrong version, or of half-copied weights, would change the batches)."""
    from relax.rollout.embedded import EmbeddedEngine

    updates_during_generation(monkeypatch, {2: 1, 3: 2, 4: 3})  # job j (call j + 1) holds until version j is staged
    swaps = []
    load = EmbeddedEngine.load_weights

    def counted(self, state_dict, version):
        load(self, state_dict, version)
        swaps.append((version, self.swapped_loads))

    monkeypatch.setattr(EmbeddedEngine, "load_weights", counted)
    runs = {}
    for stage in (True, False):
        swaps.clear()
        cfg = load_config(small_run("train.mode=hybrid", ONE_THREAD, f"rollout.stage_weights={str(stage).lower()}",
                                    steps=4))
        runs[stage] = run(cfg, output_dir=tmp_path / str(stage)).history
        # the loads of versions 1 and 2 (before jobs 2 and 3) swap in the copies staged while jobs 1 and 2 generated
        assert swaps == ([(0, 0), (1, 1), (2, 2)] if stage else [(0, 0), (1, 0), (2, 0)]), (stage, swaps)
    assert [s for s, _ in runs[True]] == [0, 1, 2, 3]
    for (_, staged), (_, copied) in zip(runs[True], runs[False], strict=True):
        assert {k: staged[k] for k in SAME_DATA} == {k: copied[k] for k in SAME_DATA}


def test_the_staleness_check_fails_a_stream_that_ignores_the_bound(in_process, small_run, tmp_path, monkeypatch):
    """Negative control of the staleness checks: a stream whose jobs all start on the first weights (the bound not
    applied; the actor made to keep every version, so that the run goes on) trains tokens older than
    max_staleness=1, and `check_staleness` says so."""
    from relax.roles import workers

    class KeepAll(workers.WeightVersions):
        def __init__(self, params, keep):
            super().__init__(params, keep=100)

    monkeypatch.setattr(rollout_stream, "version_window", lambda mode, step, max_staleness: (0, 0))
    monkeypatch.setattr(workers, "WeightVersions", KeepAll)
    cfg = load_config(small_run(ONE_THREAD, "train.mode=fully_async", "train.max_staleness=1", steps=4))
    result = run(cfg, output_dir=tmp_path / "out")
    assert max(m[STALENESS_MAX] for _, m in result.history) == 3
    with pytest.raises(AssertionError):
        check_staleness(result, 1)


@pytest.mark.parametrize("algorithm", ["grpo", "cispo", "gspo", "sapo", "m2po"])
def test_the_async_algorithms_run_fully_async_with_partial_rollout(algorithm, in_process, small_run, tmp_path,
                                                                   monkeypatch, trained_batches):
    """Every algorithm that allows asynchronous training trains fully_async with partial rollout: generations are
    interrupted by weight updates and continued with the new weights (responses whose tokens come from two
    versions), no trained token is older than max_staleness, and the algorithm's loss is finite at every step."""
    updates_during_generation(monkeypatch, {2: 1})  # job 1's first call is interrupted by version 1
    cfg = load_config(small_run(ONE_THREAD, f"algorithm={algorithm}", "train.mode=fully_async",
                                "train.max_staleness=2", "rollout.partial_rollout=true",
                                "rollout.mask_offpolicy_in_partial_rollout=true", "rollout.max_response_len=12",
                                steps=4))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1, 2, 3]
    check_staleness(result, 2)
    assert all(math.isfinite(m[LOSS]) for _, m in result.history)
    assert any(m[PARTIAL_FRAC] > 0 for _, m in result.history), "no response was interrupted and continued"
    for step, samples in trained_batches.items():
        assert len(samples) == 16 and "abort" not in samples.finish_reason  # every response finished
        versions = samples.versions()[samples.response_mask.bool()]
        assert int(versions.min()) >= step - 2 and int(versions.max()) <= step


# hybrid's exact resume after kill -9 on a real Ray: tests/runner/test_resume.py
@pytest.mark.parametrize("mode", ["hybrid", "fully_async"])
def test_resume_of_an_asynchronous_run(mode, in_process, small_run, tmp_path, trained_batches):
    """A checkpoint holds the batches generated ahead: the resumed run trains them as they were. The first resumed
    step trains exactly the batch the checkpoint buffered, and equals the uninterrupted run's step; hybrid's versions
    do not depend on timing, so its whole resumed run equals the uninterrupted one."""
    from relax.runner import checkpoint
    extra = [ONE_THREAD, "train.mode=" + mode, "train.save_interval=2"] + (
        ["train.max_staleness=2"] if mode == "fully_async" else [])
    full = run(load_config(small_run(*extra, steps=4)), output_dir=tmp_path / "a")
    uninterrupted = dict(trained_batches)
    ckpt = tmp_path / "ckpt" / "step_000002"
    saved = checkpoint.read_rollout_state(ckpt)
    buffered = {d["step"]: Samples(**d["samples"]) for d in saved["buffer"]}
    # step 1 was taken before the checkpoint, so the pump had started step 2's job; the checkpoint waits for it
    assert 2 in buffered, sorted(buffered)
    trained_batches.clear()
    resumed = run(load_config(small_run(*extra, f"train.resume={ckpt}", f"train.save_dir={tmp_path}/ckpt2", steps=4)),
                  output_dir=tmp_path / "b")
    assert [s for s, _ in resumed.history] == [2, 3]
    for name in ("sample_id", "response_ids", "response_mask", "token_version", "rollout_logp"):
        assert torch.equal(getattr(trained_batches[2], name), getattr(buffered[2], name)), name
        assert torch.equal(getattr(trained_batches[2], name), getattr(uninterrupted[2], name)), name
    assert trained_batches[2].finish_reason == buffered[2].finish_reason
    same = full.history[2:] if mode == "hybrid" else full.history[2:3]
    for (step_a, a), (step_b, b) in zip(same, resumed.history, strict=False):
        assert step_a == step_b
        assert {k: a[k] for k in SAME_DATA} == {k: b[k] for k in SAME_DATA}, step_a
