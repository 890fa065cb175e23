"""A remote reward service: `data.reward=http://host:port/path` (or https), options in `data.reward_service`.

Protocol (docs/training.md, "Rewards"): each request is `POST <url>` with `Content-Type: application/json` and, when
`data.reward_service.api_key_env` names an environment variable, `Authorization: Bearer <its value>`; the body is

    {"items": [{"response": "...", "label": "...", "prompt": "...", "messages": [...], "fields": {...}}, ...]}

(at most `batch_size` items; in a run, each item also has `messages`, the prompt's chat messages or an episode's
conversation, each image an OpenAI `image_url` part with a PNG data URL, and `fields`, the data record's other
fields: `relax.runner.rollout_driver.scoring.reward_contexts`), and the answer a 200 with

    {"rewards": [0.5, null, ...], "errors": [null, "why", ...]}

one reward per item in order: a finite number, or null for an item the service could not score (`errors`, optional,
says why). Requests run `concurrency` at a time; each is bounded by `timeout_s` (a socket time limit, and a wall-clock
bound on the whole try: a service that trickles its answer has its connection shut at `timeout_s`); a connection
error, a time-out, a 429 or a 5xx is retried `retries` times after `backoff_s`, 2 * `backoff_s`, ... seconds. A
request that still fails, an answer that is not such JSON (another 4xx status, a wrong length, a non-number), and a
null reward fail their items: never a silent zero, their groups are left out and counted in `rollout/reward_errors`.
An item whose request's last try ran out of time (no complete answer within `timeout_s`: the wall-clock bound fired,
or the socket's own time limit, `relax.rewards.timeouts.is_timeout`, by type; or the service answered 408 or 504, by
the status), or whose batch outlived its bound, is also a time-out (`score_batch`'s third list): counted in
`rollout/reward_timeouts`, as a judge's time-outs are.
Past `max_errors` failed items over the run, scoring raises `RewardServiceError` and the run stops with its message.
A batch that outlives its bound shuts the connections of its requests still in flight, so that no thread or socket
outlives the batch.

Redirects are not followed: a 3xx answer is a failed call whose error names the status and its Location (the request,
and its key, go to `data.reward` and nowhere else). The URL may not hold a user or password (`check_url`; the key
belongs in `api_key_env`). The key is read from the environment for each request sent, and never appears in a message
or a log.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Optional
from urllib.parse import urlsplit

from relax.rewards.calls import RewardContext
from relax.rewards.timeouts import is_timeout

if TYPE_CHECKING:  # relax.config imports torch (its algorithms): not at the import of every reward worker
    from relax.config.schema import RewardServiceConfig

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RewardServiceError(RuntimeError):
    """The reward service failed more items than `data.reward_service.max_errors` allows: the run stops."""


def is_url(spec: object) -> bool:
    return isinstance(spec, str) and spec.strip().lower().startswith(("http://", "https://"))


def check_url(url: str) -> Optional[str]:
    """What is wrong with `url` as a reward service address, or None (the message never holds a password)."""
    from relax.config.credentials import REWARD_KEY_INSTEAD, credentials_problem  # the config's rule (a lower layer)

    if (problem := credentials_problem("data.reward", url, REWARD_KEY_INSTEAD)) is not None:
        return problem
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"data.reward={url!r}: a reward service URL needs http:// or https:// and a host"
    try:
        _ = parts.port
    except ValueError as exc:
        return f"data.reward={url!r}: {exc}"
    return None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx is not followed (it reaches the caller as an HTTPError): the request and its key go to one address."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class _Recording:
    """An HTTP(S) handler that hands each connection's socket, once connected, to `on_connect`: whoever bounds the
    request can shut it (urllib keeps it out of reach)."""

    def __init__(self, on_connect, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_connect = on_connect

    def do_open(self, http_class, req, **kwargs):
        on_connect = self._on_connect

        class Connection(http_class):
            def connect(self):
                super().connect()
                on_connect(self.sock)

        return super().do_open(Connection, req, **kwargs)


class _HTTPHandler(_Recording, urllib.request.HTTPHandler):
    pass


class _HTTPSHandler(_Recording, urllib.request.HTTPSHandler):
    pass


def _shut(sock: socket.socket) -> None:
    """End a connection from another thread: its reader gets EOF (or an error) at once."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class _Batch:
    """The requests of one `score_batch` in flight: their sockets, and whether the batch gave up on them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = threading.Event()
        self.sockets: set[socket.socket] = set()

    def opened(self, sock: socket.socket) -> None:
        with self.lock:
            self.sockets.add(sock)
            abandoned = self.abandoned.is_set()
        if abandoned:
            _shut(sock)

    def closed(self, sock: socket.socket) -> None:
        with self.lock:
            self.sockets.discard(sock)

    def abandon(self) -> None:
        """Shut every connection still open; requests not sent yet are not sent."""
        with self.lock:
            self.abandoned.set()
            left = list(self.sockets)
        for sock in left:
            _shut(sock)


class RemoteReward:
    """Scores a batch of responses on a reward service (see the module docstring): `score_batch`."""

    def __init__(self, url: str, options: Optional[RewardServiceConfig] = None):
        from relax.config.schema import RewardServiceConfig

        """`options`: `data.reward_service` (the scoring sets the run's on the client it is given: `options` may be
        replaced before a call)."""
        if (problem := check_url(url)) is not None:
            raise ValueError(problem)
        self.url, self.options = url, options or RewardServiceConfig()
        self.__name__ = url  # what messages name it by
        self.failed_total = 0  # failed items over the run
        self.requests = 0  # requests sent, retries included
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the key
        return f"RemoteReward({self.url!r})"

    def __reduce__(self):  # not sent to worker processes (it is called in the driver, batched)
        raise TypeError("a RemoteReward is called in the driver process")

    def score_batch(self, responses: Sequence[str], labels: Sequence[str], prompts: Optional[Sequence[str]] = None,
                    contexts: Optional[Sequence[RewardContext]] = None) \
            -> tuple[list[Optional[float]], list[Optional[str]], list[bool]]:
        """(reward or None per item, the error of each failed item or None, whether each failed item timed out:
        its request's last try got no complete answer within `timeout_s`, or the batch's bound passed first); raises
        `RewardServiceError` past `max_errors` failed items over the run. `contexts`: each item's prompt, messages and
        record fields (they replace `prompts`)."""
        o = self.options
        if contexts is not None:
            items = [{"response": r, "label": lab, "prompt": c.prompt, "messages": c.messages, "fields": dict(c.fields)}
                     for r, lab, c in zip(responses, labels, contexts, strict=True)]
        else:
            items = [{"response": r, "label": lab, "prompt": None if prompts is None else prompts[i]}
                     for i, (r, lab) in enumerate(zip(responses, labels, strict=True))]
        chunks = [list(range(i, min(i + o.batch_size, len(items)))) for i in range(0, len(items), o.batch_size)]
        rewards: list[Optional[float]] = [None] * len(items)
        errors: list[Optional[str]] = [None] * len(items)
        timed_out = [False] * len(items)
        if not items:
            return rewards, errors, timed_out
        pool = ThreadPoolExecutor(max_workers=min(o.concurrency, len(chunks)), thread_name_prefix="reward-service")
        batch = _Batch()
        try:
            futures = [pool.submit(self._call_with_retries, [items[i] for i in chunk], batch) for chunk in chunks]
            # a bound on the whole batch: every chunk's tries, each within timeout_s, and the backoffs between them
            per_chunk = (o.retries + 1) * (o.timeout_s + 1.0) + o.backoff_s * (2 ** o.retries)
            deadline = time.monotonic() + per_chunk * math.ceil(len(chunks) / o.concurrency)
            for chunk, future in zip(chunks, futures, strict=True):
                try:
                    values, why, late = future.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:  # (a time-out: the bound is past every try's timeout_s and the backoffs)
                    values, why = [None] * len(chunk), [f"no answer within the batch's bound ({per_chunk:.3g} s)"] * \
                        len(chunk)
                    late = [True] * len(chunk)
                for i, v, e, t in zip(chunk, values, why, late, strict=True):
                    rewards[i], errors[i] = v, (None if v is not None else e or "no reward")
                    timed_out[i] = v is None and t
        finally:
            # requests still in flight past the bound are ended (their connections shut), not left to a service that
            # trickles: the workers return at once
            batch.abandon()
            pool.shutdown(wait=False, cancel_futures=True)
        failed = sum(r is None for r in rewards)
        with self._lock:
            self.failed_total += failed
            total = self.failed_total
        if total > o.max_errors:
            first = next((e for e in errors if e is not None), "?")
            raise RewardServiceError(f"the reward service {self.url} failed {total} items over the run, more than "
                                     f"data.reward_service.max_errors={o.max_errors}; the last error: {first}")
        return rewards, errors, timed_out

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        name = self.options.api_key_env
        if name:
            key = os.environ.get(name)
            if not key:  # validation checks it before the run; the environment may change after
                raise RewardServiceError(f"data.reward_service.api_key_env={name}: the environment variable is not set "
                                         "(or empty)")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _call_with_retries(self, items: list[dict], batch: Optional[_Batch] = None) \
            -> tuple[list[Optional[float]], list[Optional[str]], list[bool]]:
        """(rewards, errors, timed out) of `items`: the first answer's, or the last try's failure for each (a
        time-out when that try timed out)."""
        o = self.options
        batch = batch or _Batch()
        error, tries, late = "the batch's bound passed", 0, True
        for attempt in range(o.retries + 1):
            # the backoff, cut short (and no further try) once the batch is abandoned
            if batch.abandoned.wait(o.backoff_s * 2 ** (attempt - 1) if attempt else 0):
                break
            tries += 1
            retry, outcome, error, late = self._call(items, batch)
            if outcome is not None:
                return (*outcome, [False] * len(items))
            if not retry:
                break
        return [None] * len(items), [f"{error} (after {tries} tries)"] * len(items), [late] * len(items)

    def _call(self, items: list[dict], batch: _Batch) -> tuple[bool, Optional[tuple[list, list]], str, bool]:
        """One request: (retry?, (rewards, errors) when it was answered, the error otherwise, whether it failed by
        time-out). Its connection is shut `timeout_s` after it starts (an answer still arriving then is a time-out) or
        when `batch` is abandoned; the socket's own time limit (`timeout_s` per read or connect) firing first is a
        time-out too, by the exception's type (`is_timeout`)."""
        with self._lock:
            self.requests += 1
        timeout = self.options.timeout_s
        late_error = f"TimeoutError: timed out (no complete answer within data.reward_service.timeout_s={timeout:g} s)"
        body = json.dumps({"items": items}).encode()
        request = urllib.request.Request(self.url, data=body, headers=self._headers(), method="POST")
        mine: list[socket.socket] = []
        mine_lock = threading.Lock()
        late = threading.Event()

        def on_connect(sock: socket.socket) -> None:
            with mine_lock:
                mine.append(sock)
            batch.opened(sock)
            if late.is_set():
                _shut(sock)

        def at_deadline() -> None:
            late.set()
            with mine_lock:
                for sock in mine:
                    _shut(sock)

        opener = urllib.request.build_opener(_NoRedirects(), _HTTPHandler(on_connect), _HTTPSHandler(on_connect))
        timer = threading.Timer(timeout, at_deadline)
        timer.daemon = True
        timer.start()
        try:
            with opener.open(request, timeout=timeout) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as exc:
            exc.close()
            if 300 <= exc.code < 400:
                from relax.config.credentials import without_credentials

                location = exc.headers.get("Location") if exc.headers is not None else None
                return False, None, (f"HTTP {exc.code} {exc.reason}: the service redirected to "
                                     f"{without_credentials(location) if location else '(no Location)'}, and "
                                     "redirects are not followed (the request and its key go to data.reward only): "
                                     "set data.reward to the address that answers"), False
            # a status the service answered: a failure; 408 and 504 (it, or a gateway before it, ran out of time) a
            # time-out too (`is_timeout`, by the status)
            return exc.code in RETRY_STATUS, None, f"HTTP {exc.code} {exc.reason}", is_timeout(exc)
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut
            if late.is_set():
                return True, None, late_error, True
            if batch.abandoned.is_set():
                return False, None, "the batch's bound passed", True
            if is_timeout(exc):  # the socket's own limit fired before the wall-clock bound's timer
                return True, None, late_error, True
            reason = getattr(exc, "reason", exc)
            return True, None, f"{type(reason).__name__}: {reason}", False
        finally:
            timer.cancel()
            for sock in mine:
                batch.closed(sock)
        try:
            answer_json = json.loads(raw)
            values = answer_json["rewards"]
            whys = answer_json.get("errors") or [None] * len(items)
            if not isinstance(values, list) or len(values) != len(items) or len(whys) != len(items):
                raise ValueError(f"{len(items)} items sent, {len(values) if isinstance(values, list) else '?'} "
                                 "rewards answered")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if late.is_set():  # an answer without a length, cut at the deadline
                return True, None, late_error, True
            return False, None, f"an answer that is not {{'rewards': [...]}} with one per item: {exc}", False
        rewards: list[Optional[float]] = []
        errors: list[Optional[str]] = []
        for v, why in zip(values, whys, strict=True):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            rewards.append(float(v) if ok else None)
            errors.append(None if ok else (str(why) if why else f"the service answered {v!r} for this item"))
        return False, (rewards, errors), "", False
