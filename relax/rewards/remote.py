"""A remote reward service: `data.reward=http://host:port/path` (or https), options in `data.reward_service`.

Protocol (docs/training.md, "Rewards"): each request is `POST <url>` with `Content-Type: application/json` and, when
`data.reward_service.api_key_env` names an environment variable, `Authorization: Bearer <its value>`; the body is

    {"items": [{"response": "...", "label": "...", "prompt": "..."}, ...]}

(at most `batch_size` items), and the answer a 200 with

    {"rewards": [0.5, null, ...], "errors": [null, "why", ...]}

one reward per item in order: a finite number, or null for an item the service could not score (`errors`, optional,
says why). Requests run `concurrency` at a time; each is bounded by `timeout_s` (a socket time limit, and a wall-clock
bound on the whole call); a connection error, a time-out, a 429 or a 5xx is retried `retries` times after
`backoff_s`, 2 * `backoff_s`, ... seconds. A request that still fails, an answer that is not such JSON (another 4xx
status, a wrong length, a non-number), and a null reward fail their items: never a silent zero, their groups are left
out and counted in `rollout/reward_errors`. Past `max_errors` failed items over the run, scoring raises
`RewardServiceError` and the run stops with its message. The key is read from the environment for each request
sent, and
never appears in a message or a log.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Optional
from urllib.parse import urlsplit

if TYPE_CHECKING:  # relax.config imports torch (its algorithms): not at the import of every reward worker
    from relax.config.schema import RewardServiceConfig

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RewardServiceError(RuntimeError):
    """The reward service failed more items than `data.reward_service.max_errors` allows: the run stops."""


def is_url(spec: object) -> bool:
    return isinstance(spec, str) and spec.strip().lower().startswith(("http://", "https://"))


def check_url(url: str) -> Optional[str]:
    """What is wrong with `url` as a reward service address, or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"data.reward={url!r}: a reward service URL needs http:// or https:// and a host"
    try:
        _ = parts.port
    except ValueError as exc:
        return f"data.reward={url!r}: {exc}"
    return None


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

    def score_batch(self, responses: Sequence[str], labels: Sequence[str],
                    prompts: Optional[Sequence[str]] = None) -> tuple[list[Optional[float]], list[Optional[str]]]:
        """(reward or None per item, the error of each failed item or None); raises `RewardServiceError` past
        `max_errors` failed items over the run."""
        o = self.options
        items = [{"response": r, "label": lab, "prompt": None if prompts is None else prompts[i]}
                 for i, (r, lab) in enumerate(zip(responses, labels, strict=True))]
        chunks = [list(range(i, min(i + o.batch_size, len(items)))) for i in range(0, len(items), o.batch_size)]
        rewards: list[Optional[float]] = [None] * len(items)
        errors: list[Optional[str]] = [None] * len(items)
        if not items:
            return rewards, errors
        pool = ThreadPoolExecutor(max_workers=min(o.concurrency, len(chunks)), thread_name_prefix="reward-service")
        try:
            futures = [pool.submit(self._call_with_retries, [items[i] for i in chunk]) for chunk in chunks]
            # a bound on the whole batch: every chunk's tries, each within timeout_s, and the backoffs between them
            per_chunk = (o.retries + 1) * (o.timeout_s + 1.0) + o.backoff_s * (2 ** o.retries)
            deadline = time.monotonic() + per_chunk * math.ceil(len(chunks) / o.concurrency)
            for chunk, future in zip(chunks, futures, strict=True):
                try:
                    values, why = future.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    values, why = [None] * len(chunk), [f"no answer within the batch's bound ({per_chunk:.3g} s)"] * \
                        len(chunk)
                for i, v, e in zip(chunk, values, why, strict=True):
                    rewards[i], errors[i] = v, (None if v is not None else e or "no reward")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        failed = sum(r is None for r in rewards)
        with self._lock:
            self.failed_total += failed
            total = self.failed_total
        if total > o.max_errors:
            first = next((e for e in errors if e is not None), "?")
            raise RewardServiceError(f"the reward service {self.url} failed {total} items over the run, more than "
                                     f"data.reward_service.max_errors={o.max_errors}; the last error: {first}")
        return rewards, errors

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

    def _call_with_retries(self, items: list[dict]) -> tuple[list[Optional[float]], list[Optional[str]]]:
        o = self.options
        error = "?"
        for attempt in range(o.retries + 1):
            if attempt:
                time.sleep(o.backoff_s * 2 ** (attempt - 1))
            retry, outcome, error = self._call(items)
            if outcome is not None:
                return outcome
            if not retry:
                break
        return [None] * len(items), [f"{error} (after {attempt + 1} tries)"] * len(items)

    def _call(self, items: list[dict]) -> tuple[bool, Optional[tuple[list, list]], str]:
        """One request: (retry?, (rewards, errors) when it was answered, the error otherwise)."""
        with self._lock:
            self.requests += 1
        body = json.dumps({"items": items}).encode()
        request = urllib.request.Request(self.url, data=body, headers=self._headers(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.options.timeout_s) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as exc:
            return exc.code in RETRY_STATUS, None, f"HTTP {exc.code} {exc.reason}"
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            reason = getattr(exc, "reason", exc)
            return True, None, f"{type(reason).__name__}: {reason}"
        try:
            answer_json = json.loads(raw)
            values = answer_json["rewards"]
            whys = answer_json.get("errors") or [None] * len(items)
            if not isinstance(values, list) or len(values) != len(items) or len(whys) != len(items):
                raise ValueError(f"{len(items)} items sent, {len(values) if isinstance(values, list) else '?'} "
                                 "rewards answered")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return False, None, f"an answer that is not {{'rewards': [...]}} with one per item: {exc}"
        rewards: list[Optional[float]] = []
        errors: list[Optional[str]] = []
        for v, why in zip(values, whys, strict=True):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            rewards.append(float(v) if ok else None)
            errors.append(None if ok else (str(why) if why else f"the service answered {v!r} for this item"))
        return False, (rewards, errors), ""
