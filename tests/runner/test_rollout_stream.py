"""The rollout stream against a fake engine with random timings: the staleness bound, the version rule of each
mode, partial rollout (prefixes continued, versions recorded), and a checkpoint's state restored mid-run.

The fake engine generates token t of sample i as `token(i, t)`, so a response continued after any number of
interruptions can be checked token by token; its length is a function of the sample id.
"""

from __future__ import annotations

import random
import re
import threading
import time

import pytest
import torch

from relax.batch import Samples, continuation, extend_responses
from relax.config import load_config
from relax.runner.rollout_driver.stream import RolloutStream, version_window

MAX_LEN = 6


def token(sample_id: int, t: int) -> int:
    return 1 + (sample_id * 7 + t * 3) % 50


def length(sample_id: int) -> int:
    return 1 + sample_id % MAX_LEN


class FakeEngines:
    """In-process engines: one token per row per tick, a random sleep per tick, interruptible like the real one."""

    def __init__(self, rng: random.Random, tick_s: float = 0.002, load_s: float | None = None):
        self.rng, self.tick_s, self.load_s = rng, tick_s, load_s
        self.staged = -1  # the version staged (rollout.stage_weights)
        self.stage_lock = threading.Lock()
        self.loads: list[tuple[int, bool]] = []  # (version, swapped in from the staged copy)
        self.version = -1
        self.aborted: set[int] = set()
        self.lock = threading.Lock()
        self.calls = 0

    def _run(self, prompts: list[list[int]], ids: torch.Tensor, start: torch.Tensor, gen_id) -> Samples:
        N = len(ids)
        T = MAX_LEN
        out = torch.zeros(N, T, dtype=torch.long)
        n_done = torch.zeros(N, dtype=torch.long)
        finish = [""] * N
        for t in range(T):
            time.sleep(self.rng.random() * self.tick_s)
            for i in range(N):
                if finish[i]:
                    continue
                pos = int(start[i]) + t
                out[i, t] = token(int(ids[i]), pos)
                n_done[i] = t + 1
                if pos + 1 >= length(int(ids[i])):
                    finish[i] = "stop"
            if all(finish):
                break
            if gen_id is not None and gen_id in self.aborted:
                finish = [f or "abort" for f in finish]
                break
        width = int(n_done.max())
        mask = (torch.arange(width)[None] < n_done[:, None]).long()
        P = max(len(p) for p in prompts)
        return Samples(prompt_ids=torch.tensor([[0] * (P - len(p)) + p for p in prompts]),
                       prompt_mask=torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts]),
                       response_ids=out[:, :width] * mask, response_mask=mask,
                       rollout_logp=-mask.float(), finish_reason=finish, weight_version=self.version,
                       sample_id=ids.clone(), token_version=mask * self.version)

    def generate(self, prompts, sample_ids, *, seed, gen_id, items=None, cancel=None):
        with self.lock:
            self.calls += 1
            G = len(sample_ids) // len(prompts)
            rows = [p for p in prompts for _ in range(G)]
            return self._run(rows, sample_ids, torch.zeros(len(sample_ids), dtype=torch.long), gen_id)

    def resume(self, partial, *, seed, gen_id):
        with self.lock:
            self.calls += 1
            job = continuation(partial, MAX_LEN)
            more = self._run(job.prompts, job.sample_ids, job.positions, gen_id)
            return extend_responses(partial, more)

    def abort(self, gen_id):
        self.aborted.add(gen_id)

    def wake(self):
        pass

    def load_weights(self, weights, version):
        with self.lock:
            assert weights == f"w{version}"
            with self.stage_lock:  # waits for a copy in progress, as the real engine's lock does
                swapped = self.staged == version
            if not swapped:
                time.sleep(self.load_s if self.load_s is not None else self.rng.random() * self.tick_s)
            self.loads.append((version, swapped))
            self.version = version

    def stage_weights(self, weights, version):
        """Copies `weights` in a thread of its own (as a real engine's second Ray thread) for `load_s`."""
        assert weights == f"w{version}"

        def copy():
            with self.stage_lock:
                if version > max(self.version, self.staged):
                    time.sleep(self.load_s if self.load_s is not None else self.rng.random() * self.tick_s)
                    self.staged = version

        threading.Thread(target=copy, daemon=True).start()


class Prompts:
    def __init__(self):
        self.drawn = 0

    def __call__(self, n: int = 2):
        from relax.data.datasets import PromptItem

        self.drawn += 1
        return [PromptItem([self.drawn, i + 1], "label", "text", i) for i in range(n)]


CONFIG_BASE = ["algorithm=m2po", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4"]


def config(mode: str, staleness: int | None = None, *, partial: bool = False, interval: int = 1, steps: int = 8,
           aborts: int = 4):
    overrides = [*CONFIG_BASE, f"train.mode={mode}", f"train.num_rollout={steps}",
                 f"train.weight_sync_interval={interval}"]
    if staleness is not None:
        overrides.append(f"train.max_staleness={staleness}")
    if partial:
        overrides += ["rollout.partial_rollout=true", f"rollout.partial_rollout_max_aborts={aborts}"]
    return load_config(overrides)


def train(cfg, stream: RolloutStream, rng: random.Random, *, start: int = 0, stop: int | None = None,
          tick_s: float = 0.004) -> list[Samples]:
    """The loop's side: take each step's batch, "train" for a random time, publish per weight_sync_interval."""
    taken = []
    for step in range(start, stop if stop is not None else cfg.train.num_rollout):
        job, samples, _ = stream.take(step)
        assert job.step == step
        taken.append(samples)
        time.sleep(rng.random() * tick_s)
        if (step + 1) % cfg.train.weight_sync_interval == 0:
            stream.publish(step + 1, f"w{step + 1}")
    return taken


def check_batch(cfg, step: int, samples: Samples) -> None:
    """Every response complete and exactly the fake engine's tokens; versions never beyond the bound."""
    G, B = cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size
    assert samples.sample_id.tolist() == list(range(step * B * G, (step + 1) * B * G))  # nothing lost or repeated
    check_responses(cfg, step, samples)


def check_responses(cfg, step: int, samples: Samples) -> None:
    """Every response of step `step`'s batch complete and exactly the fake engine's tokens, its versions growing
    along it and within the step's version window and staleness bound."""
    assert "abort" not in samples.finish_reason
    versions = samples.versions()
    for i, sid in enumerate(samples.sample_id.tolist()):
        n = int(samples.response_mask[i].sum())
        assert n == length(sid)
        assert samples.response_ids[i, :n].tolist() == [token(sid, t) for t in range(n)]
        v = versions[i, :n]
        assert bool((v[1:] >= v[:-1]).all())  # versions only grow along a response
        lo, hi = version_window(cfg.train.mode, step, cfg.train.max_staleness)
        assert step - int(v.min()) <= cfg.train.max_staleness  # the staleness bound, per token
        assert lo <= int(v.min()) and int(v.max()) <= hi


CASES = [("sync", None, False, 1), ("hybrid", None, False, 1), ("fully_async", 0, False, 1),
         ("fully_async", 1, False, 1), ("fully_async", 3, False, 1), ("fully_async", 3, False, 4),
         ("fully_async", 2, True, 1), ("fully_async", 3, True, 2)]


@pytest.mark.parametrize("mode,staleness,partial,interval", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_staleness_bound_and_versions_hold_under_random_timings(mode, staleness, partial, interval, seed):
    cfg = config(mode, staleness, partial=partial, interval=interval)
    rng = random.Random(seed)
    engines = FakeEngines(random.Random(seed + 100), tick_s=rng.choice([0.0005, 0.002, 0.006]))
    stream = RolloutStream(cfg, engines, Prompts(), start_step=0)
    stream.publish(0, "w0")
    with stream:
        taken = train(cfg, stream, rng, tick_s=rng.choice([0.0005, 0.004, 0.02]))
    for step, samples in enumerate(taken):
        check_batch(cfg, step, samples)
    if mode == "sync":
        assert all(int(s.versions()[s.response_mask.bool()].max()) == i for i, s in enumerate(taken))
    if mode == "hybrid":
        assert [int(s.versions()[s.response_mask.bool()].max()) for s in taken] == [0] + list(range(7))


def test_partial_rollout_continues_prefixes_with_newer_versions():
    """A slow engine and a fast trainer: weight updates arrive mid-batch, the batch is interrupted (at most
    max_aborts times) and its responses span versions, each token recorded with its own."""
    cfg = config("fully_async", 3, partial=True, aborts=2, steps=6)
    engines = FakeEngines(random.Random(0), tick_s=0.03)
    stream = RolloutStream(cfg, engines, Prompts(), start_step=0)
    stream.publish(0, "w0")
    with stream:
        taken = train(cfg, stream, random.Random(1), tick_s=0.0)
    for step, samples in enumerate(taken):
        check_batch(cfg, step, samples)
    assert stream.aborts > 0
    spans = [len(set(s.versions()[i][s.response_mask[i].bool()].tolist())) for s in taken for i in range(len(s))]
    assert max(spans) > 1 and max(spans) <= 1 + 2  # an interrupted job continues at most max_aborts times


def test_a_restored_stream_continues_with_nothing_lost_or_repeated():
    """Pause mid-run, save the state, stop; a new stream from that state yields exactly the batches left: the
    buffered ones unchanged, the job in flight continued from its partial responses."""
    cfg = config("fully_async", 3, partial=True, steps=8)
    rng = random.Random(3)
    prompts = Prompts()
    engines = FakeEngines(random.Random(4), tick_s=0.01)
    stream = RolloutStream(cfg, engines, prompts, start_step=0)
    stream.publish(0, "w0")
    with stream:
        first = train(cfg, stream, rng, stop=3)
        # the pump runs ahead: wait until it has a batch buffered (a fixed 0.05 s was about what the fake engine
        # takes for one, so a loaded machine could pause with nothing buffered)
        deadline = time.monotonic() + 30
        while stream.buffered_samples() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with stream.paused():
            state = stream.state_dict()
            drawn = prompts.drawn
    buffered = {d["step"]: d["samples"] for d in state["buffer"]}
    assert buffered, "the pump ran ahead of the loop"
    assert state["next_step"] == 3 + len(buffered)  # the job in flight, if any, is next_step

    from relax.data.datasets import PromptItem

    resumed_prompts = Prompts()
    resumed_prompts.drawn = drawn  # the sampler position is restored with the checkpoint
    again = RolloutStream(cfg, FakeEngines(random.Random(5)), resumed_prompts, start_step=3)
    again.load_state_dict(state, lambda d: PromptItem(**d))
    again.publish(3, "w3")
    with again:
        rest = train(cfg, again, rng, start=3)
    for step, samples in enumerate(first + rest):
        check_batch(cfg, step, samples)
    for step, saved in buffered.items():  # what was generated before the stop is trained as it was
        assert torch.equal(rest[step - 3].response_ids, saved["response_ids"])
        assert torch.equal(rest[step - 3].versions(), saved["token_version"])


class GivingUpEngines(FakeEngines):
    """An engine that returns sample 3 as aborted although nobody asked, and then never continues it (an input it
    cannot continue): each resume hands the row back as it was, aborted again."""

    def _run(self, prompts, ids, start, gen_id):
        out = super()._run(prompts, ids, start, gen_id)
        out.finish_reason = ["abort" if int(i) == 3 else r for i, r in zip(ids, out.finish_reason, strict=True)]
        return out

    def resume(self, partial, *, seed, gen_id):
        import dataclasses

        with self.lock:
            self.calls += 1
            return dataclasses.replace(partial, finish_reason=["abort"] * len(partial))


@pytest.mark.parametrize("partial", [False, True])
def test_aborts_the_run_did_not_ask_for_stop_it_after_a_bounded_backoff(partial):
    """Rows the engine aborts by itself are continued a few times, with a growing pause, then the run stops with a
    message naming them: never a pump that spins while the heartbeats look healthy."""
    from relax.runner.errors import RunError

    cfg = config("fully_async", 1, partial=partial, steps=2)
    engines = GivingUpEngines(random.Random(0))
    stream = RolloutStream(cfg, engines, Prompts(), start_step=0)
    stream.publish(0, "w0")
    t0 = time.monotonic()
    raised: list[BaseException] = []

    def take() -> None:
        try:
            stream.take(0)
        except BaseException as exc:  # noqa: BLE001 - what the loop would see
            raised.append(exc)

    with stream:
        taker = threading.Thread(target=take, daemon=True)
        taker.start()
        taker.join(60)
        assert raised, "the stream kept continuing a request that the engine never continues"
    from relax.runner.rollout_driver.stream import UNASKED_ABORTS, UNASKED_BACKOFF_S

    assert isinstance(raised[0], RunError) and re.search(
        r"step 1: .*1 response\(s\) as aborted .* without the run asking \(sample ids \[3\]\)", str(raised[0]))
    assert engines.calls == 1 + UNASKED_ABORTS  # the first call, then one per allowed retry
    assert time.monotonic() - t0 >= UNASKED_BACKOFF_S * (2 ** UNASKED_ABORTS - 1) * 0.9  # it waited, growing


def test_a_step_that_can_never_be_generated_fails_at_once_instead_of_waiting():
    """The loop takes a step whose weights it never published (sync: job 1 needs version 1): nothing but the loop
    could unblock the pump, so `take` reports the stream's state instead of waiting without end."""
    cfg = config("sync", steps=3)
    stream = RolloutStream(cfg, FakeEngines(random.Random(0)), Prompts(), start_step=0)
    stream.publish(0, "w0")
    with stream:
        stream.take(0)
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"step 1 can never be generated .*published \[0\]"):
            stream.take(1)
        assert time.perf_counter() - t0 < 5


class SlowScorer:
    """Reward calls that take `seconds` a batch (a judge model, a code sandbox): response i's reward is its sample
    id / 1000, so each batch's scores can be matched to it."""

    def __init__(self, seconds: float):
        self.seconds, self.scored = seconds, []

    def score(self, items, samples):
        from relax.rewards.registry import Scores

        time.sleep(self.seconds)
        self.scored.append(samples.sample_id.tolist())
        return Scores([i / 1000 for i in samples.sample_id.tolist()], [False] * len(samples))

    def cancel(self):
        pass


class HeldScorer:
    """Reward calls held until `cancel` (a hung verifier): `entered` is set once the first batch is being scored."""

    def __init__(self):
        self.entered, self.cancelled = threading.Event(), threading.Event()

    def score(self, items, samples):
        self.entered.set()
        self.cancelled.wait(30)  # (bounded: the code before never cancels, and its close waits for this)
        raise RuntimeError("the reward calls were cancelled")

    def signal(self, samples, scores):
        return [True] * (len(samples) // 4)

    def cancel(self):
        self.cancelled.set()


@pytest.mark.parametrize("filtered", [False, True])
def test_closing_the_stream_stops_the_reward_calls_in_progress_rather_than_waiting_for_them(filtered):
    """A run stopped at once (a second Ctrl-C) leaves the stream while a batch is being scored: the stream cancels
    those calls (`Scoring.cancel`) and closes at once, instead of waiting for the slowest of them (before: up to 60 s
    a thread, however long a hung reward call took). Scored by the scoring thread, or by the pump with dynamic
    sampling (`filtered`: rollout.filter_groups)."""
    cfg = load_config([*CONFIG_BASE, "train.mode=sync", "train.num_rollout=2", *(
        ["rollout.filter_groups=true", "rollout.over_sampling_batch_size=2"] if filtered else [])])
    scorer = HeldScorer()
    stream = RolloutStream(cfg, FakeEngines(random.Random(0)), Prompts(), start_step=0, scorer=scorer)
    stream.publish(0, "w0")
    with stream:
        assert scorer.entered.wait(30)  # the first batch is being scored
        t0 = time.perf_counter()
    assert scorer.cancelled.is_set() and time.perf_counter() - t0 < 10


class HeldAgentRuns(FakeEngines):
    """An agent program's runs that no abort ends (they hang in their worker processes until data.agent_timeout_s):
    `generate` holds until its `cancel` event is set and `wake` called, then raises as `AgentRollout.run` does;
    `entered` once it holds."""

    def __init__(self):
        super().__init__(random.Random(0))
        self.entered, self.woken = threading.Event(), threading.Event()
        self.cancel: threading.Event | None = None

    def generate(self, prompts, sample_ids, *, seed, gen_id, items=None, cancel=None):
        self.cancel = cancel
        self.entered.set()
        self.woken.wait(30)  # (bounded: the code before never wakes it, and its close waits for this)
        if cancel is not None and cancel.is_set():
            raise RuntimeError("the agent calls were cancelled: the run stops")
        return super().generate(prompts, sample_ids, seed=seed, gen_id=gen_id, items=items)

    def wake(self):
        self.woken.set()


def test_closing_the_stream_cancels_the_agent_runs_in_flight_rather_than_waiting_for_them():
    """A run stopped at once (a second Ctrl-C) leaves the stream while an agent program's runs are in flight, which an
    abort does not end: the stream sets its engine call's `cancel` event and wakes the engines, and closes at once
    (before: it aborted the call, which the runs ignore, and waited up to 60 s for the pump)."""
    cfg = load_config([*CONFIG_BASE, "train.mode=sync", "train.num_rollout=2"])
    engines = HeldAgentRuns()
    stream = RolloutStream(cfg, engines, Prompts(), start_step=0)
    stream.publish(0, "w0")
    with stream:
        assert engines.entered.wait(30)  # the first job's agent runs are in flight
        assert engines.cancel is not None and not engines.cancel.is_set()
        t0 = time.perf_counter()
    assert engines.cancel.is_set() and time.perf_counter() - t0 < 10


def overlap_s(stream: RolloutStream) -> float:
    """Seconds during which the stream generated and scored at the same time (its timeline's spans)."""
    spans = list(stream.timeline)
    gen = [s for s in spans if s.kind == "generate"]
    return sum(max(0.0, min(g.end, s.end) - max(g.start, s.start)) for s in spans if s.kind == "score" for g in gen)


@pytest.mark.parametrize("mode", ["sync", "hybrid", "fully_async"])
def test_generation_goes_on_while_the_last_batch_is_scored(mode):
    """The pump hands each generated batch to the scoring thread and starts the next job as its mode allows: in the
    asynchronous modes the timeline shows engine calls during the reward calls of the batch before. Sync is the
    control: job j + 1 waits for the weights trained on batch j, hence for its rewards, so nothing overlaps there
    (the measure is not positive by construction). Every batch carries its own scores, each scored once, in order."""
    steps, score_s = 6, 0.15
    cfg = config(mode, 2 if mode == "fully_async" else None, steps=steps)
    scorer = SlowScorer(score_s)
    stream = RolloutStream(cfg, FakeEngines(random.Random(0), tick_s=0.04), Prompts(), start_step=0, scorer=scorer)
    stream.publish(0, "w0")
    taken = []
    with stream:
        for step in range(steps):
            job, samples, _ = stream.take(step)
            assert job.scores.rewards == [i / 1000 for i in samples.sample_id.tolist()]
            taken.append(samples)
            stream.publish(step + 1, f"w{step + 1}")
    for step, samples in enumerate(taken):
        check_batch(cfg, step, samples)
    assert scorer.scored == [s.sample_id.tolist() for s in taken]
    scored = [s for s in stream.timeline if s.kind == "score"]
    assert [s.step for s in scored] == list(range(steps))
    if mode == "sync":
        assert overlap_s(stream) == 0.0
    else:  # the jobs after the first are generated while the batch before them is scored
        assert overlap_s(stream) > 0.5 * score_s * (steps - 1), list(stream.timeline)


def load_spans_s(stream: RolloutStream) -> float:
    return sum(s.end - s.start for s in stream.timeline if s.kind == "load")


@pytest.mark.parametrize("mode", ["hybrid", "fully_async"])
def test_weights_are_copied_while_the_engines_generate_and_swapped_in_by_the_pump(mode):
    """rollout.stage_weights (on by default in the asynchronous modes on GPUs): `publish` starts the engines' copy
    of the new weights while they generate, so the pump's loads only swap them in. The control, staging off, pays
    each copy in the pump. Batches are the same either way."""
    steps, load_s = 6, 0.2

    def run(stage: bool) -> tuple[RolloutStream, FakeEngines, list[Samples]]:
        cfg = load_config([*CONFIG_BASE, f"train.mode={mode}", f"train.num_rollout={steps}",
                           f"rollout.stage_weights={str(stage).lower()}"])
        assert cfg.rollout.stage_weights is stage
        engines = FakeEngines(random.Random(0), tick_s=0.1, load_s=load_s)
        stream = RolloutStream(cfg, engines, Prompts(), start_step=0)
        stream.publish(0, "w0")
        with stream:
            taken = train(cfg, stream, random.Random(1), tick_s=0.01)
        return stream, engines, taken

    staged, engines, taken = run(True)
    versions = [v for v, _ in engines.loads]
    assert versions == sorted(set(versions)) and len(versions) >= steps - 1, versions  # (hybrid: 0 .. steps - 2)
    assert all(swapped for v, swapped in engines.loads if v > 0), engines.loads  # (version 0 comes before any job)
    plain, control, again = run(False)
    assert not any(swapped for _, swapped in control.loads)
    assert load_spans_s(plain) >= load_s * len(control.loads)
    assert load_spans_s(staged) < load_s + 0.5 * load_s * (len(versions) - 1), list(staged.timeline)
    assert [s.sample_id.tolist() for s in taken] == [s.sample_id.tolist() for s in again]


def test_weights_are_staged_by_default_in_the_async_modes_with_embedded_engines_on_gpus():
    assert load_config(["train.mode=sync"]).rollout.stage_weights is False
    assert load_config(["train.mode=hybrid", "cluster=1xgpu"]).rollout.stage_weights is True
    assert load_config(["train.mode=hybrid"]).rollout.stage_weights is False  # CPU: the copy takes generation's cores
    assert load_config(["train.mode=hybrid", "rollout.stage_weights=true"]).rollout.stage_weights is True
    sglang = load_config(["train.mode=hybrid", "rollout=sglang", "rollout.sglang.server=embedded"])
    assert sglang.rollout.stage_weights is False
    from relax.config.validate import ConfigError

    with pytest.raises(ConfigError, match="rollout.stage_weights=true has nothing to overlap with train.mode=sync"):
        load_config(["train.mode=sync", "rollout.stage_weights=true"])
    with pytest.raises(ConfigError, match="stage_weights=true is not available in this build with rollout.backend=sgl"):
        load_config(["train.mode=hybrid", "rollout=sglang", "rollout.sglang.server=embedded",
                     "rollout.stage_weights=true"])


def test_a_batch_saved_unscored_is_scored_after_the_restore():
    """A checkpoint taken while batches wait for their rewards keeps them unscored (the scoring thread stops between
    batches when the stream pauses); the restored stream scores them before the loop takes them."""
    cfg = config("fully_async", 3, steps=5)
    prompts = Prompts()
    first = SlowScorer(0.3)
    stream = RolloutStream(cfg, FakeEngines(random.Random(1), tick_s=0.001), prompts, start_step=0, scorer=first)
    stream.publish(0, "w0")
    with stream:
        stream.take(0)
        stream.publish(1, "w1")
        deadline = time.monotonic() + 30
        while stream.buffered_samples() < 16 and time.monotonic() < deadline:  # two batches generated ahead
            time.sleep(0.01)
        with stream.paused():
            state, drawn = stream.state_dict(), prompts.drawn
    unscored = [d["step"] for d in state["buffer"] if d["scores"] is None]
    assert unscored, state["buffer"]

    from relax.data.datasets import PromptItem

    resumed = Prompts()
    resumed.drawn = drawn
    second = SlowScorer(0.0)
    again = RolloutStream(cfg, FakeEngines(random.Random(2)), resumed, start_step=1, scorer=second)
    again.load_state_dict(state, lambda d: PromptItem(**d))
    again.publish(1, "w1")
    with again:
        for step in range(1, 5):
            job, samples, _ = again.take(step)
            assert job.scores.rewards == [i / 1000 for i in samples.sample_id.tolist()]
            check_batch(cfg, step, samples)
            again.publish(step + 1, f"w{step + 1}")
    rescored = [ids[0] // 8 for ids in second.scored]
    assert rescored[:len(unscored)] == unscored  # the saved unscored batches first, in step order
