"""A judge behind an OpenAI-compatible API (`reward_model.engine=openai`): SGLang's or vLLM's servers, `relax-serve`,
a vendor's endpoint. One chat completion per question, `reward_model.batch_size` of them at a time, each try bounded
by `reward_model.timeout_s` of wall-clock time; the key is read from the environment variable
`reward_model.api_key_env` when the client is made (never from a command line, never written to a log or an error
message: a server that echoes it back has it masked in the error kept).

A request that fails (refused, timed out, an HTTP error, an answer without a message) is retried `RETRIES` times with
a growing pause; if it still fails, its answer is None and its error kept: the caller counts it as a failed score. An
answer the server stopped at the token limit (`finish_reason` "length") comes back marked cut: the caller counts it
as an answer without a score, whatever its text holds (a cut answer's last number is not its verdict).

The time limit: `requests`' `timeout=` bounds each socket read, not the request, so a server that trickles its answer
(a byte now and then) would hold the run forever. Each try is watched instead (`_Deadline`): at `timeout_s` its timer
shuts down the socket of the connection the try sends on (`_Watched` connections say which that is), which ends the
blocked read in the thread that made it; the try fails as timed out and urllib3 discards the connection, so no thread
or socket outlives it. A try is also timed out when its socket's own read timeout fires first
(`relax.rewards.timeouts.is_timeout`, which the reward service's client uses too, by the exception's type: requests
raises its Timeout before the answer's headers, but a ConnectionError wrapping urllib3's ReadTimeoutError while the
body streams). An answer with status 408 or 504 (the server, or a gateway before it, ran out of time) is a time-out
too, by its status (`relax.rewards.timeouts.is_timeout_status`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import requests
from requests.adapters import HTTPAdapter

from relax.rewards.timeouts import is_timeout, is_timeout_status

RETRIES = 2  # more tries of a failed request
BACKOFF_S = 0.5  # the pause before the first retry; it doubles
FINISH_LENGTH = "length"  # OpenAI's finish_reason of an answer stopped at max_tokens (SGLang's and vLLM's too)

_trying = threading.local()  # .deadline: the _Deadline of the try this thread is making (None: none)


class _Deadline:
    """The wall-clock limit of one try, made in the calling thread (`with _Deadline(s) as d:`): past `seconds` the
    socket of the connection the try sends on is shut down (a read blocked on it returns at once); `expired` says
    whether that happened. A connection that the try takes or opens after the limit is shut as it is attached."""

    def __init__(self, seconds: float):
        self.expired = False
        self._sock: Any = None
        self._over = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        _trying.deadline = self
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._over = True
        self._timer.cancel()
        _trying.deadline = None

    def attach(self, conn: Any) -> None:
        """`conn` (a urllib3 connection) carries this try: its socket is kept (the connection lets go of it once the
        answer's headers are read when the server closes after the answer, but the answer still reads from it)."""
        sock = getattr(conn, "sock", None)
        with self._lock:
            if sock is not None:
                self._sock = sock
            if self.expired and not self._over:
                _shut(self._sock)

    def _fire(self) -> None:
        with self._lock:
            if self._over:
                return
            self.expired = True
            _shut(self._sock)


def _shut(sock: Any) -> None:
    if sock is None:
        return
    try:  # socket.socket's own shutdown: an SSLSocket's would change its TLS state from this (another) thread
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except (OSError, TypeError, ValueError):
        pass


class _Watched:
    """Mixed into a pool's connection class: a connection tells the try of its thread that it carries it, when it
    connects and when it sends a request (a kept-alive connection only does the latter)."""

    def connect(self) -> Any:
        out = super().connect()
        _attach(self)
        return out

    def request(self, *args: Any, **kwargs: Any) -> Any:
        _attach(self)
        return super().request(*args, **kwargs)


def _attach(conn: Any) -> None:
    deadline = getattr(_trying, "deadline", None)
    if deadline is not None:
        deadline.attach(conn)


_WATCHED: dict[type, type] = {}
_WATCHED_LOCK = threading.Lock()


def _watched_class(cls: type) -> type:
    with _WATCHED_LOCK:
        if cls not in _WATCHED:
            _WATCHED[cls] = type(f"Watched{cls.__name__}", (_Watched, cls), {})
        return _WATCHED[cls]


class _WatchingAdapter(HTTPAdapter):
    """requests' adapter whose pools make `_Watched` connections (of whatever class the pool uses: plain, TLS, through
    a proxy)."""

    def _watch(self, pool: Any) -> Any:
        cls = getattr(pool, "ConnectionCls", None)
        if isinstance(cls, type) and not issubclass(cls, _Watched):
            pool.ConnectionCls = _watched_class(cls)
        return pool

    def get_connection_with_tls_context(self, *args: Any, **kwargs: Any) -> Any:  # requests >= 2.32
        return self._watch(super().get_connection_with_tls_context(*args, **kwargs))

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:  # requests 2.31
        return self._watch(super().get_connection(*args, **kwargs))


class OpenAIJudge:
    """Chat completions at `url` (the API's base, `.../v1`) for `model`, `concurrency` requests at a time."""

    def __init__(self, url: str, *, model: Optional[str], api_key_env: Optional[str], max_new_tokens: int,
                 temperature: float, timeout_s: float, concurrency: int):
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model = model or "default"
        self.max_new_tokens, self.temperature, self.timeout_s = max_new_tokens, temperature, timeout_s
        key = os.environ.get(api_key_env, "").strip() if api_key_env else ""
        if api_key_env and not key:
            raise ValueError(f"reward_model.api_key_env={api_key_env}: the environment variable is not set")
        self._key = key
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="judge-http")
        self._session = requests.Session()
        adapter = _WatchingAdapter(pool_maxsize=max(10, concurrency))
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()

    def answer(self, questions: list[str | list[dict]]) -> tuple[list[Optional[str]], list[Optional[str]], list[bool],
                                                                 list[bool]]:
        """(answers, errors, cut, late): each question's answer text (None: failed), why it failed, whether the
        server stopped the answer at `max_new_tokens` (finish_reason "length"), and whether it failed by time-out
        (its last try got no answer within `timeout_s`, or the server's own 408 / 504: `is_timeout_status`). A question
        is the user message's content: its text, or OpenAI content parts (text and `image_url` parts: a judge sent
        the prompt's images, `relax.rewards.judge.judge_content`)."""
        results = list(self._pool.map(self._one, questions))
        return ([a for a, _, _, _ in results], [e for _, e, _, _ in results], [c for _, _, c, _ in results],
                [t for _, _, _, t in results])

    def _masked(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def _one(self, question: str | list[dict]) -> tuple[Optional[str], Optional[str], bool, bool]:
        body = {"model": self.model, "messages": [{"role": "user", "content": question}],
                "max_tokens": self.max_new_tokens, "temperature": self.temperature}
        late = f"{self.endpoint}: no answer within reward_model.timeout_s={self.timeout_s:g}"
        error, timed_out = None, False  # the last try's failure, and whether it was a time-out
        for attempt in range(RETRIES + 1):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            timed_out = False
            with _Deadline(self.timeout_s) as deadline:
                try:
                    reply = self._session.post(self.endpoint, json=body, headers=self._headers,
                                               timeout=self.timeout_s)
                except requests.RequestException as exc:
                    reply, timed_out = None, is_timeout(exc)
                    error = late if timed_out else \
                        f"{self.endpoint}: {type(exc).__name__}: {self._masked(str(exc))}"
            if deadline.expired:  # (what came before the socket was shut, if anything, is no answer)
                reply, error, timed_out = None, late, True
            if reply is None:
                continue
            if reply.status_code != 200:
                error = f"{self.endpoint}: HTTP {reply.status_code}: {self._masked(reply.text[:300])}"
                timed_out = is_timeout_status(reply.status_code)  # 408, 504: the server ran out of time
                if reply.status_code in (400, 401, 403, 404, 422):  # the request itself is wrong: no retry helps
                    break
                continue
            try:
                choice = reply.json()["choices"][0]
                content = choice["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                error = (f"{self.endpoint}: an answer without choices[0].message.content: "
                         f"{self._masked(reply.text[:300])}")
                continue
            cut = isinstance(choice, dict) and choice.get("finish_reason") == FINISH_LENGTH
            return ("" if content is None else str(content)), None, cut, False
        return None, error, False, timed_out  # (the last try's failure is the call's)
