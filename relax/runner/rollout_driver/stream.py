"""The rollout side of the training loop for every `train.mode`: prompts in, trainable batches out.

A job is one rollout batch: the prompts of training step j (`rollout_batch_size` prompts from the sampler,
`n_samples_per_prompt` samples each). A pump thread runs the jobs in step order on the rollout engines and
puts finished batches in a buffer; the loop `take`s batch j when it trains step j and `publish`es the weights
of version j + 1 after it. The trainer's version at step j is j (the number of steps it has trained), and the
version of a token is the version of the weights that generated it. The modes differ in one rule only, which
weights job j may start with (`version_window`):

- `sync`: exactly version j. Generate -> train -> publish, strictly on-policy.
- `hybrid`: exactly version j - 1 (one step off): job j + 1 generates with version j while the trainer trains
  step j. Versions do not depend on timing, so a hybrid run is as reproducible as a sync run.
- `fully_async`: the newest weights published, at least version j - `train.max_staleness`. The pump waits (never
  drops) until such weights exist, so every token the trainer sees satisfies
  `trainer_version - token_version <= max_staleness`. The buffer is bounded by the same rule: job j cannot start
  before the trainer has trained step j - max_staleness - 1.

Partial rollout (`rollout.partial_rollout`, fully_async): publishing weights interrupts the job in flight after
its current token (`Engines.abort`); the pump loads the new weights and the unfinished responses continue from
their prefix, each token recording the version that generated it. Engines whose jobs are made of many requests
(agent programs behind the OpenAI gateway: `loads_weights_in_flight`) are not interrupted: the new weights are
loaded at once, the requests in flight finish with theirs and later requests get the new ones. A job is interrupted
at most `rollout.partial_rollout_max_aborts` times; after that, new weights wait until it finishes.

Each finished batch goes to the buffer at once and is scored there by a scoring thread (`Scorer.score`, batches in
step order), so the pump starts the next job while the rewards of the last one are computed: in the asynchronous
modes generation goes on while rewards are scored and while the trainer trains, and `take` returns a batch once it
is scored (`timeline` records both threads' calls and the loads). With `rollout.stage_weights` (the asynchronous
modes' default on embedded engines) `publish` also starts the engines' copy of the new weights while they generate,
so that the pump's load of that version only swaps it in. With dynamic sampling (`rollout.filter_groups`) a job is
generated in rounds of `rollout.over_sampling_batch_size` prompts: after each round the groups whose rewards carry
no learning signal are set aside (which needs their rewards: the pump scores these rounds itself), and rounds go on
until `rollout_batch_size` groups with a signal are collected or `rollout.max_filter_rounds` rounds were generated;
the batch is then the first groups with a signal in draw order, filled with groups without one if there are too few
(`relax.runner.rollout_driver.scoring.choose_groups`). Every round of a job obeys the job's version rule, and the
batch keeps its size, so the modes' guarantees hold as they are.

Sampling is deterministic per sample: a response's tokens are drawn from the random stream of (seed, sample
id, position) (`relax.rollout.sampling.counter_uniforms`), so a sample is a function of its weights only,
whatever batch, replica or interruption it goes through. `state_dict` holds the sampler position, the buffered
batches and the job in flight with its partial responses: restored, the stream continues with nothing lost and
nothing generated twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from relax.batch import FinishReason, Samples, concat_samples
from relax.config.schema import RelaxConfig
from relax.rewards.registry import Scores
from relax.runner.branch_rows import fill_saved_old_logprobs
from relax.runner.errors import RunError, step_name
from relax.runner.rollout_driver.scoring import (
    FilterStats,
    choose_groups,
    mean_reward,
    merge_scores,
    scores_state,
    select_scores,
)

WAIT_POLL_S = 1.0  # how often a waiting `take` checks that the pump is still alive
# An engine that returns rows as aborted without the run asking (an input past its context, an engine that gives up
# on a request) gets them back, with a growing pause, this many times in a row; then the run stops naming them.
UNASKED_ABORTS = 4
UNASKED_BACKOFF_S = 0.25  # the first pause; it doubles each time
TIMELINE_LEN = 1000  # the most recent engine and scoring calls kept in `RolloutStream.timeline`


class Engines(Protocol):
    """The rollout engines as the stream drives them (`relax.runner.rollout_driver.engines.started_engines`, or a fake
    in tests). Engines with a true `loads_weights_in_flight` attribute take `load_weights` during a call (see the
    module docstring)."""

    def generate(self, prompts: list[list[int]], sample_ids: torch.Tensor, *, seed: int,
                 gen_id: int | None, evaluation: bool = False, items: list | None = None,
                 cancel: threading.Event | None = None) -> Samples:
        """Responses for `prompts` (a group per prompt), rows in `sample_ids` order (`evaluation`: with the eval
        sampling, rollout.eval_*); `items`: the prompts' items (an agentic rollout's episodes start from them);
        `cancel`, set (then `wake`) from another thread, stops what no abort ends (an agent program's runs): the call
        raises."""

    def resume(self, partial: Samples, *, seed: int, gen_id: int | None) -> Samples:
        """`partial`'s interrupted responses continued with the current weights, rows in the same order."""

    def abort(self, gen_id: int) -> None:
        """Interrupt call `gen_id` after its current token (returns at once)."""

    def wake(self) -> None:
        """From another thread, once it set the `cancel` event of the `generate` in progress: that call reads it now."""

    def load_weights(self, weights: Any, version: int) -> None:
        """Load `weights` (what `publish` received) into every engine."""

    def stage_weights(self, weights: Any, version: int) -> None:
        """Start copying `weights` into every engine beside its generation; returns at once (rollout.stage_weights:
        embedded engines only). The next `load_weights` of `version` then swaps them in."""


class Scoring(Protocol):
    """The rewards of generated batches (`relax.runner.rollout_driver.scoring.Scorer`, or a fake in tests)."""

    def score(self, items: list, samples: Samples) -> Scores:
        """The reward calls of `samples` (a group per item)."""

    def signal(self, samples: Samples, scores: Scores) -> list[bool]:
        """Per group: whether it carries a learning signal (dynamic sampling keeps those)."""

    def cancel(self) -> None:
        """From another thread: stop the `score` in progress (it may raise); the stream is closing."""


@dataclass
class Job:
    step: int
    items: list  # the prompts (relax.data.datasets.PromptItem), one group each
    sample_ids: torch.Tensor  # [len(items) * group size]
    scores: Scores | None = None  # the reward calls of the batch's responses (None: the stream has no scorer)
    # dynamic sampling: the ids of samples generated for this batch and set aside, and how the batch was built
    filtered_ids: torch.Tensor | None = None
    filter: FilterStats | None = None


@dataclass(frozen=True)
class Span:
    """One call of the stream's threads: `kind` "generate" (an engine call of job `step`), "score" (its batch's
    reward calls) or "load" (the engines taking the weights of version `step`), from `start` to `end`
    (time.perf_counter())."""

    kind: str
    step: int
    start: float
    end: float


@dataclass
class _Round:
    """A generated and scored round of a job (more than one with dynamic sampling)."""

    items: list
    samples: Samples
    scores: Scores | None
    signal: list[bool] | None  # per group (dynamic sampling only)


@dataclass
class _InFlight:
    step: int
    items: list  # the prompts of the round being generated
    sample_ids: torch.Tensor  # their sample ids
    done: list[Samples] = field(default_factory=list)  # finished rows of the round so far
    partial: Samples | None = None  # interrupted rows to continue
    aborts: int = 0
    unasked: int = 0  # engine calls in a row that returned aborted rows the stream did not ask to abort
    rounds: list[_Round] = field(default_factory=list)  # finished rounds of the job


def version_window(mode: str, step: int, max_staleness: int) -> tuple[int, float]:
    """(lowest, highest) weight version job `step` may start with in `mode` (see the module docstring)."""
    if mode == "sync":
        return step, step
    if mode == "hybrid":
        return max(0, step - 1), max(0, step - 1)
    return max(0, step - max_staleness), float("inf")


def sample_ids(first_prompt: int, num_prompts: int, group_size: int) -> torch.Tensor:
    """Ids of the samples of prompts number `first_prompt`.. (draw order), `group_size` each: prompt * G + j."""
    start = first_prompt * group_size
    return torch.arange(start, start + num_prompts * group_size, dtype=torch.long)


def samples_state(samples: Samples) -> dict:
    return {f.name: getattr(samples, f.name) for f in dataclasses.fields(Samples)}


def _items_state(items: list) -> list[dict]:
    return [dataclasses.asdict(i) for i in items]


class RolloutStream:
    """Jobs of steps `start_step`.. `num_steps - 1`, generated by a pump thread; see the module docstring.

    `draw(n)` returns the next `n` prompts (the sampler; called by the pump only, or while paused); `scorer` scores
    each generated batch (None: jobs carry no scores; dynamic sampling needs one). Use as a context manager: the
    pump starts on enter and stops on exit.
    """

    def __init__(self, cfg: RelaxConfig, engines: Engines, draw: Callable[[int], list], *, start_step: int,
                 pad_token_id: int = 0, scorer: Scoring | None = None):
        t, ro = cfg.train, cfg.rollout
        self.mode, self.max_staleness = t.mode, t.max_staleness
        self.partial_rollout, self.max_aborts = ro.partial_rollout, ro.partial_rollout_max_aborts
        self.stage_weights = bool(ro.stage_weights)
        self.group_size, self.batch_prompts = ro.n_samples_per_prompt, ro.rollout_batch_size
        self.num_steps, self.seed, self.pad_token_id = t.num_rollout, cfg.seed, pad_token_id
        self.engines, self.draw, self.scorer = engines, draw, scorer
        self.filter_groups = ro.filter_groups
        if self.filter_groups and scorer is None:
            raise ValueError("RolloutStream: rollout.filter_groups needs a scorer")
        self.round_prompts = ro.over_sampling_batch_size if ro.filter_groups else ro.rollout_batch_size
        self.max_rounds = ro.max_filter_rounds if ro.filter_groups else 1
        self._cond = threading.Condition()
        self._loading = threading.Lock()
        self._next_step = start_step  # the next job to start
        self._next_prompt = start_step * self.batch_prompts  # draw index of the next prompt (keys its sample ids)
        self._floor = start_step  # the first version published (a resumed run has no older weights)
        self._buffer: deque[tuple[Job, Samples]] = deque()
        self._current: _InFlight | None = None
        self._published: dict[int, Any] = {}  # version -> weights not yet superseded
        self.engine_version = -1  # what the engines hold (-1: nothing published yet)
        self._gen_id = 0
        self._running: int | None = None  # gen id of the engine call in progress
        self._asked: set[int] = set()  # gen ids the stream asked the engines to abort
        self._paused = 0
        self._at_rest = True  # the pump is not inside an engine call
        self._closed = False
        self._cancel = threading.Event()  # set when the stream closes: its engine calls' `cancel`
        self._error: BaseException | None = None
        self._scoring: int | None = None  # the step whose batch the scoring thread is scoring
        self.busy_s = 0.0  # seconds the engines spent generating (for the idle fraction)
        self.aborts = 0  # interruptions so far
        self.timeline: deque[Span] = deque(maxlen=TIMELINE_LEN)
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> RolloutStream:
        self._threads = [threading.Thread(target=self._pump, name="rollout-pump", daemon=True)]
        if self.scorer is not None:
            self._threads.append(threading.Thread(target=self._score_loop, name="rollout-scoring", daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._closed = True
            if self._running is not None:
                self._asked.add(self._running)
                self.engines.abort(self._running)
            # what no abort ends, an agent program's runs in flight, is cancelled rather than waited for
            self._cancel.set()
            self.engines.wake()
            # a batch being scored (by the scoring thread, or by the pump for dynamic sampling) is never taken now:
            # its reward calls are stopped rather than waited for (a run stopped at once, by a second Ctrl-C, would
            # otherwise wait for the slowest of them), and so are those of a batch about to be scored
            if self.scorer is not None:
                self.scorer.cancel()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=60)

    # ------------------------------------------------------------------ the loop's side
    def publish(self, version: int, weights: Any) -> None:
        """The trainer's weights of `version`; with partial rollout they interrupt the job in flight (or, on
        engines that take weights between the calls of a running job, are loaded now)."""
        load_now = False
        with self._cond:
            self._published[version] = weights
            cur = self._current
            if (self.partial_rollout and self._running is not None and cur is not None
                    and cur.aborts < self.max_aborts and version > self.engine_version):
                if getattr(self.engines, "loads_weights_in_flight", False):
                    load_now = True
                    cur.aborts += 1
                    self.aborts += 1
                else:
                    self._asked.add(self._running)
                    self.engines.abort(self._running)
            self._cond.notify_all()
        if load_now:  # the job's requests in flight finish with their weights, the next ones get these
            self._load(version)
        elif self.stage_weights:  # copied into the engines while they generate; the pump's load swaps them in
            self.engines.stage_weights(weights, version)

    def take(self, step: int) -> tuple[Job, Samples, float]:
        """(job, samples, seconds waited) of step `step`, once its batch is generated and scored."""
        t0 = time.perf_counter()
        with self._cond:
            while True:
                self._raise_if_failed()
                if self._buffer:
                    job = self._buffer[0][0]
                    if job.step != step:
                        raise RuntimeError(f"rollout stream: asked for step {step}, next is {job.step}")
                    if job.scores is not None or self.scorer is None:
                        break  # (else the scoring thread is on it, or on the batches before it)
                elif self._at_rest and self._work() is None:  # only this thread could change that: it never will
                    raise RuntimeError(f"rollout stream: step {step} can never be generated ({self._describe()}); "
                                       "this is a bug in Relax, please report it with this message")
                self._cond.wait(WAIT_POLL_S)
            job, samples = self._buffer.popleft()
            self._cond.notify_all()
        return job, samples, time.perf_counter() - t0

    def buffered_samples(self) -> int:
        """Finished samples waiting in the buffer."""
        with self._cond:
            return sum(len(s) for _, s in self._buffer)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The pump stopped between engine calls (a job may be half done) and the scoring thread between batches
        (some may be left unscored: `state_dict` keeps them so): for evaluation and checkpoints."""
        with self._cond:
            self._paused += 1
        try:
            with self._cond:
                while not self._at_rest or self._scoring is not None:
                    self._raise_if_failed()
                    self._cond.wait(WAIT_POLL_S)
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def load_newest(self) -> int:
        """Load the newest published weights into the engines (call while `paused`); returns their version."""
        with self._cond:
            newest = max(self._published, default=self.engine_version)
        if newest > self.engine_version:
            self._load(newest)
        return self.engine_version

    # ------------------------------------------------------------------ checkpoint
    def save_old_logprobs(self, logprobs: Callable[[Samples, int], torch.Tensor], version: int) -> None:
        """Store in every sample generated ahead (`Samples.saved_old_logp`) the trainer's log-probs of its tokens
        older than `version` under their own weights (`logprobs(samples, version)`, the actor's), which a resumed
        trainer (at `version`) no longer has. Call while `paused`, before `state_dict`."""
        def fill(samples: Samples) -> None:
            stale = samples.response_mask.bool() & (samples.versions() < version)
            if bool(stale.any()):
                samples.saved_old_logp = torch.where(stale, logprobs(samples, version), torch.tensor(float("nan")))
            fill_saved_old_logprobs(samples, logprobs, version)  # agent runs' other rows (their episode records)

        for _, samples in self._buffer:
            fill(samples)
        cur = self._current
        if cur is not None:
            for samples in [r.samples for r in cur.rounds] + cur.done + ([cur.partial] if cur.partial else []):
                fill(samples)

    def state_dict(self) -> dict:
        """Everything generated or drawn but not yet trained (call while `paused`): tensors, lists and numbers."""
        cur = self._current
        return {
            "next_step": self._next_step,
            "next_prompt": self._next_prompt,
            "buffer": [self._job_state(job, samples) for job, samples in self._buffer],
            "current": None if cur is None else {
                "step": cur.step, "items": _items_state(cur.items), "sample_ids": cur.sample_ids,
                "aborts": cur.aborts, "done": [samples_state(s) for s in cur.done],
                "partial": None if cur.partial is None else samples_state(cur.partial),
                "rounds": [{"items": _items_state(r.items), "samples": samples_state(r.samples),
                            "scores": None if r.scores is None else scores_state(r.scores), "signal": r.signal}
                           for r in cur.rounds]},
        }

    def load_state_dict(self, state: dict, make_item: Callable[[dict], Any]) -> None:
        """Restore `state_dict()` (before entering); `make_item` rebuilds a prompt item from its dict."""
        def items(d: list) -> list:
            return [make_item(i) for i in d]

        def scores(d: dict | None) -> Scores | None:
            return None if d is None else Scores(**d)

        def job(d: dict) -> Job:
            stats = d.get("filter")
            return Job(int(d["step"]), items(d["items"]), d["sample_ids"], scores(d.get("scores")),
                       d.get("filtered_ids"), None if stats is None else FilterStats(**stats))

        self._next_step = int(state["next_step"])
        self._buffer = deque((job(d), Samples(**d["samples"])) for d in state["buffer"])
        cur = state["current"]
        self._current = None if cur is None else _InFlight(
            int(cur["step"]), items(cur["items"]), cur["sample_ids"], [Samples(**s) for s in cur["done"]],
            None if cur["partial"] is None else Samples(**cur["partial"]), aborts=int(cur["aborts"]),
            rounds=[_Round(items(r["items"]), Samples(**r["samples"]), scores(r["scores"]), r["signal"])
                    for r in cur.get("rounds", [])])
        # (a state written before the prompt counter: one batch of prompts per job)
        in_flight = 0 if self._current is None else 1
        self._next_prompt = int(state.get("next_prompt", (self._next_step + in_flight) * self.batch_prompts))

    @staticmethod
    def _job_state(job: Job, samples: Samples) -> dict:
        return {"step": job.step, "items": _items_state(job.items), "sample_ids": job.sample_ids,
                "samples": samples_state(samples),
                "scores": None if job.scores is None else scores_state(job.scores),
                "filtered_ids": job.filtered_ids,
                "filter": None if job.filter is None else dataclasses.asdict(job.filter)}

    # ------------------------------------------------------------------ the pump
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _weights_for(self, step: int) -> int | None:
        """The version job `step` would run with now (loading it if newer than the engines'), or None: wait."""
        lo, hi = version_window(self.mode, step, self.max_staleness)
        # a resumed run starts from version start_step: a job its mode wants on older weights gets those
        hi = max(hi, self._floor)
        best = max([v for v in self._published if v <= hi] + [self.engine_version])
        return best if best >= lo else None

    def _load(self, version: int) -> None:
        with self._loading:  # the pump's loads and the loop's loads in flight, one at a time, versions growing
            with self._cond:
                if version <= self.engine_version or version not in self._published:
                    return
                weights = self._published[version]
            t0 = time.perf_counter()
            self.engines.load_weights(weights, version)
            with self._cond:
                self.timeline.append(Span("load", version, t0, time.perf_counter()))
                self.engine_version = version
                for v in [v for v in self._published if v < version]:
                    del self._published[v]  # superseded: versions only grow

    def _work(self) -> tuple[_InFlight | None, int] | None:
        """Under the lock: the engine call the pump can make now, as (the job in flight, or None for a new one, and
        the weight version for it), or None: nothing until the loop publishes, takes or unpauses."""
        if self._paused or self._closed:
            return None
        cur = self._current
        if cur is not None and cur.partial is not None:  # continue interrupted responses with the newest weights
            version = self._weights_for(cur.step)
            return None if version is None else (cur, version)
        if self._next_step >= self.num_steps:
            return None
        version = self._weights_for(self._next_step)
        return None if version is None else (cur, version)

    def _next_call(self) -> tuple[_InFlight, int] | None:
        """Under the lock: `_work()`, with the prompts of a new job drawn."""
        if (work := self._work()) is None:
            return None
        cur, version = work
        if cur is None:
            items, ids = self._draw_round()
            cur = self._current = _InFlight(self._next_step, items, ids)
        return cur, version

    def _describe(self) -> str:
        """Under the lock: the stream's state, for an error message."""
        cur = self._current
        return (f"mode {self.mode}, next job {self._next_step} of {self.num_steps}, in flight "
                f"{'none' if cur is None else f'step {cur.step} (partial: {cur.partial is not None})'}, buffered "
                f"{[j.step for j, _ in self._buffer]}, published {sorted(self._published)}, engines at "
                f"{self.engine_version}, paused {self._paused}, closed {self._closed}")

    def _draw_round(self) -> tuple[list, torch.Tensor]:
        """Under the lock: the prompts of a new generation round and their sample ids."""
        items = self.draw(self.round_prompts)
        ids = sample_ids(self._next_prompt, len(items), self.group_size)
        self._next_prompt += len(items)
        return items, ids

    def _wait_for(self, work: Callable[[], Any]) -> Any:
        """Under the lock: the first non-None answer of `work()`, waiting for the other threads' notifications
        between tries; None once the stream is closed."""
        while (found := work()) is None:
            if self._closed:
                return None
            self._cond.wait()
        return found

    def _pump(self) -> None:
        try:
            while True:
                with self._cond:
                    if (work := self._wait_for(self._next_call)) is None:
                        return
                    cur, version = work
                    self._at_rest = False
                    self._gen_id += 1
                    gen_id = self._gen_id if self.partial_rollout else None
                try:
                    if version != self.engine_version:
                        self._load(version)
                    with self._cond:
                        self._running = gen_id
                    t0 = time.perf_counter()
                    if cur.partial is not None:
                        out = self.engines.resume(cur.partial, seed=self.seed, gen_id=gen_id)
                    else:
                        out = self.engines.generate([i.prompt_ids for i in cur.items], cur.sample_ids,
                                                    seed=self.seed, gen_id=gen_id, items=cur.items,
                                                    cancel=self._cancel)
                    t1 = time.perf_counter()
                    self.busy_s += t1 - t0
                    with self._cond:
                        self.timeline.append(Span("generate", cur.step, t0, t1))
                        self._running = None
                        finished = self._settle(cur, out, asked=gen_id in self._asked)
                        self._asked.discard(gen_id)
                    if finished is None and cur.unasked:  # the engine gave up on rows by itself: pause, then again
                        time.sleep(UNASKED_BACKOFF_S * 2 ** (cur.unasked - 1))
                    if finished is not None:  # the round is complete; dynamic sampling's next move needs its rewards
                        scores = signal = None
                        if self.filter_groups:
                            scores = self._score(cur.step, cur.items, finished)
                            signal = self.scorer.signal(finished, scores)
                        with self._cond:
                            self._close_round(cur, _Round(cur.items, finished, scores, signal))
                finally:
                    with self._cond:
                        self._running = None
                        self._at_rest = True
                        self._cond.notify_all()
        except BaseException as exc:  # surfaces in the loop's next take()
            with self._cond:
                self._error = exc
                self._at_rest = True
                self._cond.notify_all()

    def _score(self, step: int, items: list, samples: Samples) -> Scores:
        t0 = time.perf_counter()
        scores = self.scorer.score(items, samples)
        with self._cond:
            self.timeline.append(Span("score", step, t0, time.perf_counter()))
        return scores

    def _score_loop(self) -> None:
        """The scoring thread: the buffered batches without scores, in step order (those dynamic sampling scored in
        the pump have theirs; a restored state may hold some without)."""
        try:
            while True:
                with self._cond:
                    if (entry := self._wait_for(self._unscored)) is None:
                        return
                    job, samples = entry
                    self._scoring = job.step
                try:
                    scores = self._score(job.step, job.items, samples)
                    with self._cond:
                        job.scores = scores
                finally:
                    with self._cond:
                        self._scoring = None
                        self._cond.notify_all()
        except BaseException as exc:  # surfaces in the loop's next take()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _unscored(self) -> tuple[Job, Samples] | None:
        """Under the lock: the first buffered batch without scores, unless paused or closed."""
        if self._paused or self._closed:
            return None
        return next(((job, samples) for job, samples in self._buffer if job.scores is None), None)

    def _settle(self, cur: _InFlight, out: Samples, *, asked: bool = True) -> Samples | None:
        """Under the lock: file an engine call's rows as finished or to be continued; returns the round's samples
        (in sample id order) once every row is finished, else None. `asked`: the stream aborted this call (new
        weights, closing); aborted rows it did not ask for count towards `UNASKED_ABORTS` (RunError beyond)."""
        aborted = torch.tensor([r == FinishReason.ABORT for r in out.finish_reason], dtype=torch.bool)
        if bool(aborted.any()):
            if asked:
                cur.aborts += 1
                self.aborts += 1
                cur.unasked = 0
            else:
                cur.unasked += 1
                if cur.unasked > UNASKED_ABORTS:
                    ids = out.sample_id[aborted].tolist()
                    raise RunError(f"{step_name(cur.step)}: the rollout engine returned {len(ids)} response(s) as "
                                   f"aborted {cur.unasked} times in a row without the run asking (sample ids "
                                   f"{ids[:8]}{' ...' if len(ids) > 8 else ''}): a request it cannot continue, such "
                                   "as an input past the model's context; see the engine's log")
            cur.partial = out.select(aborted.nonzero().squeeze(-1))
            if not bool(aborted.all()):
                cur.done.append(out.select((~aborted).nonzero().squeeze(-1)))
            return None
        cur.done.append(out)
        cur.partial, cur.unasked = None, 0
        return self._merge(cur.done)

    def _merge(self, parts: list[Samples]) -> Samples:
        """Rows of several engine calls as one batch in sample id order; engine time adds up (calls in turn)."""
        if len(parts) == 1:
            return parts[0]
        merged = concat_samples(parts, self.pad_token_id)
        merged = merged.select(torch.argsort(merged.sample_id))
        merged.engine_time = sum(s.engine_time for s in parts)
        return merged

    def _close_round(self, cur: _InFlight, finished: _Round) -> None:
        """Under the lock: a generated and scored round of job `cur`. With dynamic sampling another round is drawn
        until the batch can be filled with groups that carry a signal, or the round limit is reached; then the job's
        batch goes to the buffer."""
        cur.rounds.append(finished)
        cur.done = []
        if self.filter_groups:
            with_signal = sum(sum(r.signal or ()) for r in cur.rounds)
            if with_signal < self.batch_prompts and len(cur.rounds) < self.max_rounds:
                cur.items, cur.sample_ids = self._draw_round()
                return
        self._buffer.append(self._assemble(cur))
        self._current = None
        self._next_step += 1

    def _assemble(self, cur: _InFlight) -> tuple[Job, Samples]:
        """The batch of a job from its rounds: all of it, or with dynamic sampling the chosen groups
        (`choose_groups`), the others' sample ids kept as set aside."""
        rounds = cur.rounds
        if not self.filter_groups:
            (r,) = rounds
            return Job(cur.step, r.items, cur.sample_ids, r.scores), r.samples
        G = self.group_size
        samples = self._merge([r.samples for r in rounds])
        items = [i for r in rounds for i in r.items]
        scores = merge_scores([r.scores for r in rounds if r.scores is not None])
        signal = [s for r in rounds for s in (r.signal or ())]
        chosen, filled = choose_groups(signal, self.batch_prompts)
        rows = [g * G + j for g in chosen for j in range(G)]
        picked = set(rows)
        left = torch.tensor([i for i in range(len(samples)) if i not in picked], dtype=torch.long)
        batch = samples.select(torch.tensor(rows, dtype=torch.long))
        stats = FilterStats(rounds=len(rounds), generated_groups=len(signal),
                            no_signal_groups=len(signal) - sum(signal), filled_groups=filled,
                            generated_reward=mean_reward(scores))
        job = Job(cur.step, [items[g] for g in chosen], batch.sample_id, select_scores(scores, rows),
                  samples.sample_id[left], stats)
        return job, batch
