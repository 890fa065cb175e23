"""Whether a failed reward call ran out of time, by the exception's type (`is_timeout`): the one rule that both HTTP
scorers use to tell a time-out (counted in `rollout/reward_timeouts`) from another failure. The judge behind an
OpenAI-compatible API (`relax.rewards.openai_judge`, through `requests`) and a reward service
(`relax.rewards.remote`, through `urllib`).

What a try that ran out of time raises, or holds as what it wraps: the socket's own (`socket.timeout` is the built-in
`TimeoutError`; urllib wraps it in a URLError's `reason` when it fires while connecting), requests' `Timeout` (a
connect, or a read before the headers), urllib3's `TimeoutError` (ReadTimeoutError, which requests wraps in a
ConnectionError when the read timed out while the body streamed). Not urllib3's `NewConnectionError`, a
ConnectTimeoutError by its class only: a refused or unresolvable address (requests leaves it out of its Timeout too).

requests and urllib3 are not imported here: this module is imported wherever `relax.rewards.registry` is (every
reward worker), and an exception can only be of their types when they are already imported, so their types are read
from `sys.modules` when a call is checked.
"""

from __future__ import annotations

import sys


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
    urllib3's `reason`, its cause and context) is one of the time-out types (less the exceptions, `timeout_types`).
    By type, never by the message's words."""
    yes, no = timeout_types()
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, yes) and not isinstance(e, no):
            return True
        todo += [a for a in (*getattr(e, "args", ()), getattr(e, "reason", None), e.__cause__, e.__context__)
                 if isinstance(a, BaseException)]
    return False
