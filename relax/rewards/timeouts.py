"""Whether a failed reward call ran out of time, by the exception's type (`is_timeout`): the one rule that both HTTP
scorers use to tell a time-out (counted in `rollout/reward_timeouts`) from another failure. The judge behind an
OpenAI-compatible API (`relax.rewards.openai_judge`, through `requests`) and a reward service
(`relax.rewards.remote`, through `urllib`).

What a try that ran out of time raises, or holds as what it wraps: the socket's own (`socket.timeout` is the built-in
`TimeoutError`; urllib wraps it in a URLError's `reason` when it fires while connecting), requests' `Timeout` (a
connect, or a read before the headers), urllib3's `TimeoutError` (ReadTimeoutError, which requests wraps in a
ConnectionError when the read timed out while the body streamed). Not urllib3's `NewConnectionError`, a
ConnectTimeoutError by its class only: a refused or unresolvable address (requests leaves it out of its Timeout too).

An HTTP answer whose status says the server (or a gateway before it) ran out of time, 408 Request Timeout or 504
Gateway Timeout (`TIMEOUT_STATUS`), is a time-out too, by its status (`is_timeout_status`; in an exception: urllib's
HTTPError's `code`, requests' HTTPError's `response.status_code`), never by its text. A refused connection, a reset,
and any other status (a 500, a 503, a 429) are failures, not time-outs.

requests and urllib3 are not imported here: this module is imported wherever `relax.rewards.registry` is (every
reward worker), and an exception can only be of their types when they are already imported, so their types are read
from `sys.modules` when a call is checked.
"""

from __future__ import annotations

import sys
from typing import Optional

# 408 Request Timeout (the server gave up waiting for the request), 504 Gateway Timeout (a gateway gave up waiting
# for the server behind it): the call ran out of time, on the far side
TIMEOUT_STATUS = frozenset({408, 504})


def is_timeout_status(status: Optional[int]) -> bool:
    """Whether an HTTP answer's status says that the call ran out of time (`TIMEOUT_STATUS`)."""
    return status in TIMEOUT_STATUS


def http_status(exc: BaseException) -> Optional[int]:
    """The HTTP status an exception carries (urllib's HTTPError: `code`; requests' HTTPError: its response's
    `status_code`), None for one that carries none (a refused connection, a reset, a socket time-out)."""
    if (urllib_error := sys.modules.get("urllib.error")) is not None and isinstance(exc, urllib_error.HTTPError):
        return exc.code
    if (requests := sys.modules.get("requests")) is not None and isinstance(exc, requests.HTTPError):
        response = exc.response
        return getattr(response, "status_code", None) if response is not None else None
    return None


def timeout_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(the types that make a time-out, the types that do not although they are among the former's subclasses)."""
    yes: list[type[BaseException]] = [TimeoutError]
    no: list[type[BaseException]] = []
    if (requests := sys.modules.get("requests")) is not None:
        yes.append(requests.Timeout)
    if (urllib3_exceptions := sys.modules.get("urllib3.exceptions")) is not None:
        yes.append(urllib3_exceptions.TimeoutError)
        no.append(urllib3_exceptions.NewConnectionError)
    return tuple(yes), tuple(no)


def is_timeout(exc: BaseException) -> bool:
    """Whether `exc`, raised by a try, says that it ran out of time: it or what it wraps (its args, urllib's and
    urllib3's `reason`, its cause and context) is one of the time-out types (less the exceptions, `timeout_types`),
    or an HTTP error whose status is 408 or 504 (`http_status`, `TIMEOUT_STATUS`). By type and status, never by the
    message's words."""
    yes, no = timeout_types()
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if (isinstance(e, yes) and not isinstance(e, no)) or is_timeout_status(http_status(e)):
            return True
        todo += [a for a in (*getattr(e, "args", ()), getattr(e, "reason", None), e.__cause__, e.__context__)
                 if isinstance(a, BaseException)]
    return False
