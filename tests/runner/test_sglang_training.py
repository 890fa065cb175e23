"""`relax-train rollout=sglang` end to end on CPU: two embedded servers (relax-serve, SGLang's protocol over real HTTP)
behind the real sglang-router, started as Ray actors; weights synced every step, an engine killed mid-run, the weights
sent from the actor's process, partial rollout's aborts and continuations. LoRA adapters through SGLang's adapter
endpoints drive the same servers from roles in this process (`in_process`): what it checks is the adapters' bytes,
versions and log-probs, not Ray."""

from __future__ import annotations

import time

import psutil
import pytest
import torch

from relax.config import load_config
from relax.metrics import (
    FAULT_RESTARTS_ROLLOUT,
    PARTIAL_FRAC,
    RAW_REWARD,
    STALENESS_MAX,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF,
    WEIGHT_BUCKETS,
)
from relax.runner.train import run

pytestmark = pytest.mark.slow

SGLANG = ["rollout=sglang", "rollout.sglang.server=embedded", "rollout.num_replicas=2",
          "rollout.sglang.startup_timeout_s=120"]
# the killed-engine run's health checks: a killed server is noticed within four rounds of checks (a round waits up to
# 5 s on each server, longer under load: with eight misses a kill could go unnoticed until the run ended); a live one
# starved of CPU by the other test workers (two cores, three workers) may miss a check or two, not four in a row of
# 5 s each. (Each check generates a token on every server: the runs that kill nothing keep the default interval.)
WATCH_CLOSELY = ["rollout.sglang.health_check_interval_s=1", "rollout.sglang.health_failures=4"]


def test_grpo_trains_on_each_steps_weights_through_two_embedded_servers_and_survives_a_killed_engine(
        ray_local, tmp_path):
    """Sync GRPO on the default task with the rollout over HTTP: every step's tokens carry the version pushed that
    step and their rollout log-probs are the trainer's on-policy ones (fp32), so the servers generate with exactly
    the weights trained so far (that the algorithm learns on this task is tests/runner/test_training.py's, in
    process); a server killed mid-run is replaced without a lost sample."""
    import kill_engine_reward

    # the kill lands in step 2 (kill_engine_reward), its replacement serves the steps after it (three steps: time
    # for the replacement to load and take its place before the run ends and stops the servers, under load too)
    steps = 6
    cfg = load_config([*SGLANG, *WATCH_CLOSELY, "algorithm=grpo", f"train.num_rollout={steps}", "seed=1",
                       "model.dtype=float32", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
                       "train.global_batch_size=8", "train.micro_batch_size=8",
                       "data.reward=kill_engine_reward:reward",
                       "data.reward_timeout_s=null",  # the reward runs in this process (its count is the test's)
                       "tracking.enabled=false",
                       "tracking.progress=false", "train.save=false"])
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == list(range(steps))
    for _, m in result.history:
        assert m[STALENESS_MAX] == 0.0  # the servers answered with the weights of this very step
        assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < 1e-4  # rollout log-probs = the trainer's on-policy log-probs
        assert m[WEIGHT_BUCKETS] == 1  # the tiny model's weights fit one bucket (tests/sglang split bigger ones)
    assert len(result.series(RAW_REWARD)) == steps
    assert len(kill_engine_reward.killed) == 1
    restarts = [m[FAULT_RESTARTS_ROLLOUT] for _, m in result.history]
    assert restarts[:2] == [0.0, 0.0] and restarts[-1] == 1.0, restarts  # one replacement, from step 2 on
    # the run's servers are gone with it: stopped, or (an actor still busy at the end) killed with their actor, when
    # the kernel delivers their parent-death signal (PR_SET_PDEATHSIG), a moment after the actor's death
    _, alive = psutil.wait_procs(kill_engine_reward.servers(), timeout=10)
    assert alive == []


def update_mid_generation(monkeypatch, version: int = 1, timeout_s: float = 120.0) -> None:
    """The publish of `version` interrupts job `version` mid-response by construction, over real HTTP: from the
    moment that job is sent, the servers are held in place (`/pause_generation` mode=in_place) and their token counts
    read (/v1/loads: prompt and output tokens of every unfinished row); once these exceed the job's prompt tokens, an
    unfinished response holds generated tokens and the hold stays (else generation continues for a moment and the
    hold is tried again). The publish waits for that hold, then aborts the held requests (pause mode=abort), loads
    the weights and continues. Job `version` starts without that publish (the weights it may use are older), so the
    two cannot wait for each other."""
    import threading

    import requests

    from relax.rollout.sglang.client import auth_headers, post
    from relax.runner.rollout_driver.sglang_engines import SGLangEngines
    from relax.runner.rollout_driver.stream import RolloutStream

    held, failed = threading.Event(), []
    generate, publish = SGLangEngines.generate, RolloutStream.publish

    def tokens(engines) -> int:
        loads = [requests.get(u + "/v1/loads", timeout=10, headers=auth_headers(engines.api_key)).json()["loads"][0]
                 for u in engines.urls]
        return sum(load["num_used_tokens"] + load["num_waiting_uncached_tokens"] for load in loads)

    def hold(engines, prompt_tokens: int) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for u in engines.urls:
                post(u, "/pause_generation", {"mode": "in_place"}, api_key=engines.api_key)
            if tokens(engines) > prompt_tokens:
                held.set()
                return
            for u in engines.urls:
                post(u, "/continue_generation", {}, api_key=engines.api_key)
            time.sleep(0.005)
        failed.append(f"job {version} never held a generated token")
        held.set()

    def generate_then_hold(self, prompts, sample_ids, **kw):
        if int(sample_ids[0]) // len(sample_ids) == version and not held.is_set():  # job j's ids start at j * size
            G = len(sample_ids) // len(prompts)
            threading.Thread(target=hold, args=(self, G * sum(len(p) for p in prompts)), daemon=True).start()
        return generate(self, prompts, sample_ids, **kw)

    def publish_after_the_hold(self, v, weights):
        if v == version:
            assert held.wait(timeout_s) and not failed, failed or f"job {version} was never held"
        publish(self, v, weights)

    monkeypatch.setattr(SGLangEngines, "generate", generate_then_hold)
    monkeypatch.setattr(RolloutStream, "publish", publish_after_the_hold)


def test_partial_rollout_aborts_and_resumes_responses_over_http(ray_local, small_run, tmp_path, trained_batches,
                                                               monkeypatch):
    """fully_async with partial rollout: weight updates pause the servers (abort), the partial responses continue
    from their prefix with the new weights, and no response is lost: every step trains its whole batch (the sample
    ids of its prompts, each once), every response finished (stop or length, never abort), and the run's ledger
    verifies."""
    from relax.cli.verify_run import verify

    steps, G, B = 3, 4, 4  # updates 1 and 2 within the staleness bound of 2
    update_mid_generation(monkeypatch)  # version 1 interrupts job 1 (the other update: wherever it lands)
    cfg = load_config(small_run(*SGLANG, "algorithm=m2po", "train.mode=fully_async", "train.max_staleness=2",
                                "rollout.partial_rollout=true", "rollout.max_response_len=32", steps=steps))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == list(range(steps))
    for step, m in result.history:
        assert 0 <= m[STALENESS_MAX] <= min(2, step)
    assert sorted(trained_batches) == list(range(steps))
    eos = set(cfg_eos(cfg))
    interrupted = 0
    for step, samples in trained_batches.items():
        assert samples.sample_id.tolist() == list(range(step * B * G, (step + 1) * B * G))  # the whole batch, once
        lengths = samples.response_mask.sum(1)
        for i, reason in enumerate(samples.finish_reason):
            n = int(lengths[i])
            assert reason in ("stop", "length"), (step, i, reason)
            if reason == "length":
                assert n == cfg.rollout.max_response_len, (step, i, n)
            else:
                assert n >= 1 and int(samples.response_ids[i, n - 1]) in eos, (step, i)
            versions = samples.token_version[i, :n]
            assert bool((versions[1:] >= versions[:-1]).all()), (step, i)  # continued with newer weights only
            interrupted += int(versions[0] != versions[-1])
    assert interrupted > 0, "no response was interrupted and continued"
    assert sum(m[PARTIAL_FRAC] for _, m in result.history) > 0
    report = verify(result.run_id, cfg.tracking.uri)
    assert report.ok, report.text()


def cfg_eos(cfg) -> list[int]:
    from relax.data.tokenizer import load_tokenizer, stop_token_ids

    return list(stop_token_ids(cfg.model, load_tokenizer(cfg.model)))


def test_lora_adapter_updates_through_sglangs_adapter_endpoints(in_process, small_run, tmp_path, trained_batches):
    """rollout.lora_sync=adapter on rollout=sglang: each update is a PEFT directory the server loads
    (/load_lora_adapter), every request names it (lora_path), only the adapters travel (perf/sync_bytes), and the
    rollout log-probs are the trainer's (fp32): the adapters act in the server as in the trainer."""
    cfg = load_config(small_run("rollout=sglang", "rollout.sglang.server=embedded",
                                "rollout.sglang.startup_timeout_s=120", "model.lora_rank=4", "model.lora_alpha=8",
                                "train.lr=0.05", "rollout.lora_sync=adapter", "model.dtype=float32",
                                "algorithm.use_tis=true", "rollout.rollout_batch_size=2", steps=2))
    result = run(cfg, output_dir=tmp_path / "out")
    m = cfg.model
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    h, i = m.hidden_size, m.intermediate_size
    per_layer = 4 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))  # rank 4, every linear but the head
    assert result.series("perf/sync_bytes") == [4.0 * per_layer * m.num_layers] * 2
    for step, samples in trained_batches.items():  # each step's tokens come from the adapters of that step
        assert set(samples.token_version[samples.response_mask.bool()].tolist()) == {step}
    # the trainer's recomputed log-probs (use_tis) against the server's: the same policy, to float rounding
    assert max(result.series("rollout/train_rollout_logp_abs_diff")) < 1e-4


class PeakRSS:
    """This process's resident memory above its level at the start, at its highest: the kernel's own high-water mark
    (VmHWM), reset at the start (`echo 5 > /proc/self/clear_refs`), which sees every peak however short.

    Before the reset, glibc hands the free memory of its heaps back to the kernel (malloc_trim): memory an earlier
    test freed stays resident in the heap, and an allocation that reuses it raises no peak (a copy of the weights
    there would go unseen; the control's allocation did, on a CI worker after other tests: a peak of 0)."""

    def __init__(self):
        self.peak = 0

    @staticmethod
    def _status(field: str) -> int:
        """A memory field of /proc/self/status, in bytes."""
        import re

        with open("/proc/self/status") as f:
            return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) << 10

    def __enter__(self) -> PeakRSS:
        import ctypes
        import ctypes.util

        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
        except OSError as e:
            pytest.skip(f"the peak needs a resettable high-water mark (/proc/self/clear_refs: {e})")
        self.base = self._status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.peak = self._status("VmHWM") - self.base


def _free_resident_heap(nbytes: int) -> list[torch.Tensor]:
    """Leaves more than `nbytes` of freed, still resident memory in glibc's heap, as a worker's earlier tests may: 20 MB
    tensors (after one freed, glibc's mmap threshold rises above their size and they come from the heap), all freed
    but the last, which holds the heap's top so that the free ones are not trimmed on free. Returns the last."""
    chunk = 5_000_000  # float32: 20 MB
    torch.ones(chunk)  # an mmapped one, freed at once: the threshold rises to 20 MB
    tensors = [torch.ones(chunk) for _ in range(nbytes // (4 * chunk) + 2)]
    return tensors[-1:]


def test_weights_go_from_the_actor_to_the_servers_not_through_the_driver(ray_local, small_run, tmp_path):
    """The driver (this process) only orchestrates: the actor's process sends each version to the servers. Its peak
    memory during a run does not grow with the model: with a model of about 200 MB of weights, the driver's peak
    rises by far less than the weights. (Through the driver, each step held the weights twice: a copy fetched from
    the actor and one in shared memory for the servers, about 4x the weights in all.)"""
    import gc

    large = ["model.hidden_size=512", "model.intermediate_size=4096", "model.head_dim=64", "model.num_layers=8"]
    cfg = load_config(small_run("rollout=sglang", "rollout.sglang.server=embedded", "rollout.num_replicas=1",
                                "rollout.sglang.startup_timeout_s=120", "model.dtype=float32", *large,
                                "rollout.rollout_batch_size=2", "rollout.max_response_len=8",
                                "tracking.enabled=false", "train.save=false", "train.save_dir=null",
                                steps=1))  # one version (0) sent: the actor's snapshot
    gc.collect()
    with PeakRSS() as rss:
        result = run(cfg, output_dir=tmp_path / "large")
    sent = result.series("perf/sync_bytes")[-1]
    assert sent > 200e6, sent
    # the driver's own allocations (imports, Ray's buffers) vary by tens of MB from run to run; a copy of the weights
    # would add at least their size (through the driver, each step held them twice: about 4x in all)
    assert rss.peak < 0.4 * sent, (rss.peak, sent)
    # the control: the same measurement sees an allocation of the weights' size in this process, freed at once, also
    # where freed memory of that size is still resident in the heap (without the trim, its peak is 0)
    held = _free_resident_heap(int(sent))
    with PeakRSS() as control:
        torch.ones(int(sent) // 4).add_(1)  # written: resident, if only for a moment
    assert control.peak > 0.9 * sent, (control.peak, sent)
    del held
