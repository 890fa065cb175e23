"""The embedded server's scheduler (`relax.serve.sglang.server`): the rows waiting for and running in the engine,
the engine calls that generate them, aborts, pauses, and who holds the engine (a batch, or a weight operation).

One thread collects every waiting request and generates them together, one `EmbeddedEngine.generate` call per set
of rows whose sampling settings (temperature, top_p, top_k, stop tokens) agree; requests that arrive meanwhile wait
for the next batch. An abort (`/abort_request`, `/pause_generation`) interrupts the engine after the current token:
the aborted rows return their tokens so far with finish_reason abort, the other rows continue from their prefix with
their own random streams (the tokens they would have drawn anyway). "retract" and "in_place" pauses keep the
interrupted rows until `/continue_generation`, as SGLang does: "retract" moves them back to the queue (they count as
waiting), "in_place" keeps them in the running batch (they count as running, and `flush_cache` fails while they are
there, as SGLang's does with their cache kept); either way they continue from their prefix then, with the weights
loaded at that time (the answer reports that version). Weight updates, memory release and resume wait for the
running batch (and its continuations), so the tokens of one batch come from one weight version, the `weight_version`
its answers report. The engine keeps no cache between batches: `flush_cache` has nothing to flush; it answers 400
while a request runs or waits (200 while generation is paused and no batch runs, unless an in_place pause keeps
rows in the running batch).

Stop strings and streams need each token as it is drawn: an engine call with such rows (`Row.watched`) hands the
engine a `_Watch` per row through its episode protocol (`EmbeddedEngine.generate(episodes=..., turn_limit=1)`):
every token ends a "turn", whose watcher records it (`Row.live`, a stream's progress), looks for the row's stop
strings in its decoded tail and ends the row at the token that completed one, or lets it go on (an empty
observation). Sampling is untouched: the rows keep their random streams and share the call with any other rows.
The price: a few host operations per row and token of such a call (the engine reads each turn's token back; a stop
string costs the decoding of a few tokens), none for calls without such rows.

Constrained rows (`Row.matcher`: json_schema, regex, ebnf) hand the engine their grammar matchers, which keep their
state across the engine calls of a row that is interrupted and continued.

An engine that records routes (`EmbeddedEngine.record_routes`: a server started with --enable-return-routed-experts)
gives each call's rows the experts of every token it fed; a row keeps those of its last call (`Row.routes`), which
fed its whole prefix again (a continued row's prefill), so they cover its prompt and output.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch

from relax.batch import FinishReason
from relax.rollout.grammar import DEAD_END_CODE
from relax.serve.sglang.request import NotReady, Request, Row

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
StopMatch = Callable[[Row], Optional[str]]  # the stop string a row's output so far completed, or None


@dataclass(frozen=True)
class Load:
    """What runs and waits now (/get_load, /v1/loads): rows (samples, SGLang's requests) and their tokens."""

    running: int  # rows of the running batch that have not ended
    waiting: int  # rows queued (paused ones included)
    paused: int  # rows queued while generation is paused
    used_tokens: int  # prompt and output tokens of the running rows
    pending_tokens: int  # prompt and output tokens of the queued rows
    throughput: float  # tokens per second of the last engine call


def _size(rows: list[Row]) -> int:
    """The tokens (prompt and output so far) of `rows`."""
    return sum(len(r.prompt) + len(r.tokens) + len(r.live) for r in rows)


class _Watch:
    """One row of an engine call, seen through the engine's episode protocol: every token ends a turn
    (turn_limit=1), `turn_end` records it and answers [] (no observation: go on) or None (end the row: a stop
    token, or a stop string completed, `Row.matched`)."""

    def __init__(self, row: Row, stop_match: StopMatch):
        self.row, self.stop_match = row, stop_match
        self.partial: list[int] = []  # the engine's episode fields
        self.end: Optional[str] = None
        self.wants_logps = row.options.return_logprob  # a stream reports each token's log-prob as it is drawn
        self.wants_top = row.wants_top  # and with top_logprobs_num its alternatives

    def turn_logps(self, logps: list[float]) -> None:
        """The log-probs of the tokens `turn_end` gets next (before them: a reader never sees a token without)."""
        self.row.live_logps.extend(logps)

    def turn_top(self, top: list[list[tuple[float, int]]]) -> None:
        """The alternatives of the tokens `turn_end` gets next (before them, as their log-probs)."""
        self.row.live_top.extend(top)

    def turn_end(self, tokens: list[int], stop_token: Optional[int], context: int) -> Optional[list[int]]:
        row = self.row
        if row.matcher is not None and row.matcher.dead:  # drawn where its grammar allowed nothing: no answer's token
            del row.live_logps[len(row.live):], row.live_top[len(row.live):]
            self.end = FinishReason.STOP
            return None
        row.live.extend(tokens)
        row.request.progress.set()
        if stop_token is None and row.options.stop:
            row.matched = self.stop_match(row)
        if stop_token is not None or row.matched is not None:
            self.end = FinishReason.STOP
            return None
        return []

    def record(self) -> dict:
        return {}


class Scheduler:
    """Runs the rows of submitted requests on one `EmbeddedEngine`; every state change happens under `cv`.

    `version()` is the weight version now (read as each engine call starts). `start(engine)` starts the scheduling
    thread; `stop()` aborts every row and ends it.
    """

    def __init__(self, version: Callable[[], str]):
        self.cv = threading.Condition()
        self.engine: Any = None
        self._version = version
        self._queue: list[Row] = []  # rows waiting for the engine (retracted rows first)
        self._parked: list[Row] = []  # rows an in_place pause keeps in the running batch (they run first)
        self._batch: list[Row] = []  # rows of the batch the scheduler is running
        self._active: set[int] = set()  # ids of the rows inside the current engine call
        self._interrupt = False  # read by the engine after every token
        self._owner: Optional[str] = None  # who uses the engine/model now: "generate" or a weight operation
        self._ops_waiting = 0  # weight operations waiting for the engine: no new batch starts meanwhile
        self._paused: Optional[str] = None
        self.released: set[str] = set()  # memory tags released (/release_memory_occupation): nothing runs
        self.stopping = False
        self._stop_match: StopMatch = lambda row: None
        self._throughput = 0.0

    # ------------------------------------------------------------------------------------------------ lifecycle

    def start(self, engine: Any, stop_match: StopMatch) -> threading.Thread:
        """Start scheduling on `engine`, finding stop strings with `stop_match`; returns the (daemon) thread."""
        self.engine, self._stop_match = engine, stop_match
        thread = threading.Thread(target=self._schedule, name="relax-serve-scheduler", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """Abort every row (their answers say so) and end the scheduling thread."""
        with self.cv:
            self.stopping = True
            self.abort_where(lambda r: True, "the server is shutting down")
            self.cv.notify_all()

    # ------------------------------------------------------------------------------------------------ requests

    def submit(self, request: Request) -> None:
        """Queue the unfinished rows of `request` (NotReady while shutting down)."""
        with self.cv:
            if self.stopping:
                raise NotReady("the server is shutting down")
            waiting = [r for r in request.rows if r.finish is None]
            if not waiting:
                request.done.set()
            self._queue.extend(waiting)
            self.cv.notify_all()

    def _finish(self, row: Row, finish: dict) -> None:
        """Record a row's end (caller holds the lock); its request answers once every row ended."""
        if row.finish is not None:
            return
        row.finish, row.live, row.live_logps = finish, [], []  # a failed engine call leaves its tokens uncommitted
        row.request.progress.set()
        if all(r.finish is not None for r in row.request.rows):
            row.request.done.set()

    def abort_where(self, match: Callable[[Row], bool], message: str) -> int:
        """Abort the matching rows: queued ones end now, running ones after the engine's current token."""
        with self.cv:
            hits = 0
            keep = []
            for row in self._queue:
                if match(row):
                    self._finish(row, {"type": "abort", "message": message})
                    hits += 1
                else:
                    keep.append(row)
            self._queue = keep
            parked = []
            for row in self._parked:
                if match(row):
                    self._finish(row, {"type": "abort", "message": message})
                    hits += 1
                else:
                    parked.append(row)
            self._parked = parked
            for row in self._batch:
                if row.finish is None and match(row):
                    row.abort = row.abort or message
                    hits += 1
                    if id(row) in self._active:
                        self._interrupt = True
            self.cv.notify_all()
            return hits

    # ------------------------------------------------------------------------------------- pause, continue, state

    def pause(self, mode: str) -> None:
        """Pause generation (`mode` one of PAUSE_MODES); returns once no engine call runs."""
        with self.cv:
            self._paused = mode
            if mode == "abort":
                self.abort_where(lambda r: True, "aborted by /pause_generation")
            elif mode == "retract" and self._parked:  # an earlier in_place pause's rows, retracted now
                self._queue[:0], self._parked = self._parked, []
            if mode != "abort" and self._active:
                self._interrupt = True
            while self._owner == "generate":  # returns once no engine call runs
                self.cv.wait()

    def unpause(self) -> None:
        """Continue generation: held and waiting rows run again."""
        with self.cv:
            self._paused = None
            self.cv.notify_all()

    def held(self) -> bool:
        """Whether generation is held on purpose (paused, or memory released)."""
        with self.cv:
            return self._paused is not None or bool(self.released)

    def idle(self) -> bool:
        """Whether no batch runs and no request waits to run (waiting while paused counts as idle)."""
        with self.cv:
            return self._owner != "generate" and not self._parked and (not self._queue or self._paused is not None)

    def waiting(self) -> bool:
        """Whether requests wait to run (generation not paused)."""
        with self.cv:
            return bool(self._queue or self._parked) and self._paused is None

    def state(self) -> dict:
        """The queue and running counts, pause and memory state (server_info's internal_states)."""
        with self.cv:
            queued = len({id(r.request) for r in self._queue})
            running = len({id(r.request) for r in self._batch + self._parked if r.finish is None})
            return {"#queue-req": queued, "#running-req": running, "#running-rows": len(self._active),
                    "paused": self._paused, "memory_released": sorted(self.released)}

    def load(self) -> Load:
        """The rows running and waiting now, and their tokens."""
        with self.cv:
            running = [r for r in self._batch + self._parked if r.finish is None]
            return Load(running=len(running), waiting=len(self._queue),
                        paused=len(self._queue) if self._paused is not None else 0, used_tokens=_size(running),
                        pending_tokens=_size(self._queue), throughput=self._throughput)

    def progress(self, request: Request) -> list[tuple[list[int], list[float], Optional[list], Optional[dict]]]:
        """(tokens so far, their log-probs, their alternatives (None: not asked), finish_reason or None) of each row
        of `request`, as they stand together now. Log-probs are those of a row that reports them (return_logprob),
        alternatives those of one with top_logprobs_num; the tokens are cut to them then."""
        with self.cv:
            out = []
            for r in request.rows:
                tokens, logps = r.tokens + r.live, r.logps + r.live_logps
                top = r.top + r.live_top if r.wants_top else None
                if r.options.return_logprob:
                    tokens = tokens[:len(logps)]  # the engine thread appends a token's log-prob first
                if top is not None:
                    tokens = tokens[:len(top)]  # and its alternatives
                    top = top[:len(tokens)]
                out.append((tokens, logps[:len(tokens)], top, r.finish))
            return out

    def set_released(self, tags: set[str], released: bool) -> None:
        """Record memory tags as released (nothing runs meanwhile) or resumed."""
        with self.cv:
            if released:
                self.released |= tags
            else:
                self.released -= tags
                self.cv.notify_all()

    @contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """Hold the model for `what`: waits for the running batch (and its continuations); no batch starts."""
        with self.cv:
            self._ops_waiting += 1
            try:
                while self._owner is not None and not self.stopping:
                    self.cv.wait()
            finally:
                self._ops_waiting -= 1
            if self.stopping:
                raise NotReady("the server is shutting down")
            self._owner = what
        try:
            yield
        finally:
            with self.cv:
                self._owner = None
                self.cv.notify_all()

    # ---------------------------------------------------------------------------------------------- the thread

    def _can_run(self) -> bool:
        return (bool(self._queue or self._parked) and self._paused is None and not self.released and self._owner is None
                and self._ops_waiting == 0)

    def _schedule(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and not self._can_run():
                    self.cv.wait()
                if self.stopping:
                    return
                batch, self._queue, self._parked = self._parked + self._queue, [], []
                self._batch, self._owner = batch, "generate"
            try:
                self._run_batch(batch)
            except Exception as exc:
                logger.exception("generation failed")
                with self.cv:
                    for row in batch:
                        if row.finish is None:
                            row.request.error = f"generation failed: {type(exc).__name__}: {exc}"
                            self._finish(row, {"type": "abort", "message": row.request.error})
            finally:
                with self.cv:
                    self._batch, self._active, self._owner = [], set(), None
                    self.cv.notify_all()

    def _run_batch(self, batch: list[Row]) -> None:
        """Generate `batch` to the end: engine calls per sampling key; interrupted rows that were not aborted
        continue from their prefix (or wait, when generation was paused with retract/in_place)."""
        pending, held = batch, []
        while pending:
            groups: dict[tuple, list[Row]] = {}
            for row in pending:
                groups.setdefault(row.key, []).append(row)
            pending = []
            for key, rows in groups.items():
                with self.cv:
                    live = []
                    for row in rows:
                        if row.finish is not None:
                            continue
                        if row.abort is not None:
                            self._finish(row, {"type": "abort", "message": row.abort})
                        elif self._paused is not None or self.stopping:
                            held.append(row)
                        else:
                            live.append(row)
                    if not live:
                        continue
                    self._interrupt = False
                    self._active = {id(r) for r in live}
                    version = self._version()
                out = self._engine_call(key, live)
                with self.cv:
                    self._active = set()
                    for i, row in enumerate(live):
                        n = int(out.response_mask[i].sum())
                        if out.routed_experts is not None:  # this call fed the row's prefix, then its n new tokens
                            fed = len(row.prompt) + len(row.tokens)
                            P = out.prompt_ids.shape[1]
                            row.routes = torch.cat([out.routed_experts[i, P - fed:P], out.routed_experts[i, P:P + n]])
                        row.tokens.extend(out.response_ids[i, :n].tolist())
                        row.logps.extend(out.rollout_logp[i, :n].tolist())
                        row.top.extend(row.live_top[:n])
                        row.live, row.live_logps, row.live_top, row.version = [], [], [], version
                        if row.matcher is not None and row.matcher.dead:  # its last token is no answer's:
                            # drawn where the grammar allowed none, it leaves the row (a stream never shows it)
                            del row.tokens[-1:]
                            del row.logps[len(row.tokens):], row.top[len(row.tokens):]
                            row.request.error = row.matcher.dead_end_error(len(row.tokens))  # DEAD_END(_NO_QUOTE)
                            row.request.error_status = 400  # the request's grammar, not the server, is at fault
                            row.request.error_code = DEAD_END_CODE  # what its answer says it is
                            self._finish(row, {"type": "abort", "message": row.request.error})
                            continue
                        finish = self._finish_reason(row, out.finish_reason[i])
                        if finish is not None:
                            self._finish(row, finish)
                        elif row.abort is not None:
                            self._finish(row, {"type": "abort", "message": row.abort})
                        elif self._paused is not None or self.stopping:
                            held.append(row)
                        else:
                            pending.append(row)  # interrupted for another row's abort: continue now
        with self.cv:
            for row in held:
                if row.abort is not None:
                    self._finish(row, {"type": "abort", "message": row.abort})
            kept = [r for r in held if r.finish is None]
            if self._paused == "in_place" and not self.stopping:
                self._parked.extend(kept)  # still in the running batch, as SGLang keeps them
            else:
                self._queue[:0] = kept

    @staticmethod
    def _finish_reason(row: Row, reason: str) -> Optional[dict]:
        """SGLang's finish_reason of a row the engine ended with `reason` (None: it was interrupted): the
        `max_new_tokens` limit first, then a stop token or string."""
        if reason == FinishReason.LENGTH or (reason == FinishReason.STOP and row.matched is not None
                                             and len(row.tokens) >= row.max_new):
            return {"type": "length", "length": row.max_new}
        if reason == FinishReason.STOP:
            if row.matched is None and row.tokens[-1] not in row.key[3]:  # a grammar completed without a stop token
                return {"type": "stop", "matched": None}
            return {"type": "stop", "matched": row.matched if row.matched is not None else row.tokens[-1]}
        return None

    def _engine_call(self, key: tuple, rows: list[Row]) -> Any:
        temperature, top_p, top_k, stops = key
        budgets = [r.max_new - len(r.tokens) for r in rows]
        watch = {"episodes": [_Watch(r, self._stop_match) for r in rows], "turn_limit": 1} \
            if any(r.watched for r in rows) else {}
        if any(r.matcher is not None for r in rows):  # constrained rows (their matchers go on across calls)
            watch["grammars"] = [r.matcher for r in rows]
        if any(r.vision is not None for r in rows):  # rows with images (SGLang's image_data): encoded per row
            watch["vision"] = [r.vision for r in rows]
        self.engine.eos_token_ids = list(stops)  # only this thread generates
        t0 = time.perf_counter()
        out = self.engine.generate(
            [r.prompt + r.tokens for r in rows], max_new_tokens=max(budgets), temperature=temperature, top_p=top_p,
            top_k=top_k, seed=0, sample_ids=torch.tensor([r.stream for r in rows], dtype=torch.long),
            positions=torch.tensor([len(r.tokens) for r in rows], dtype=torch.long),
            budgets=torch.tensor(budgets, dtype=torch.long), should_abort=lambda: self._interrupt, **watch)
        self._throughput = float(out.response_mask.sum()) / max(time.perf_counter() - t0, 1e-9)
        return out
