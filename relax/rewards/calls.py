"""One reward call, checked: the value a reward function returns for a response, or the failure, never raised.

What a reward function may return: a number (a float, int, bool, numpy scalar or 0-d tensor); a `RewardValue`
(a float with `counts`, numbers summed over the batch: the code_tests rewards count their sandbox runs there); or
verl's `compute_score` form, a dict `{"score": x, "acc": 1.0, ...}` whose `score` is the reward and whose other
numeric values are logged, each as the batch's mean, rollout/reward/<key>_mean (`RewardValue.extras`). An
`async def` function is awaited here, in the process that makes the call (a reward worker when
`data.reward_timeout_s` is set, whose time limit covers the whole coroutine).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import threading
import traceback
from collections.abc import Callable
from typing import Any, Optional

RewardFn = Callable[..., float]


class RewardSpecError(ValueError):
    """`data.reward` names no usable function; raised at start, before any rollout."""


# One call's outcome: (reward, None) or (None, traceback or message of the failure).
Outcome = tuple[Optional[float], Optional[str]]


class RewardValue(float):
    """A reward that also says what its call did. `counts` (name -> number) are summed over a batch into
    `Scores.counts` (the `code_tests` reward counts its sandbox runs and their time-outs there); `extras` (name ->
    number: a dict return's other keys) are kept per response in `Scores.extras` and logged as their mean over the
    batch's scored responses. Pickles as a float with both, so it comes back from a worker process whole."""

    counts: dict[str, float]
    extras: dict[str, float]

    def __new__(cls, value: float, counts: Optional[dict[str, float]] = None,
                extras: Optional[dict[str, float]] = None) -> RewardValue:
        obj = super().__new__(cls, value)
        obj.counts = dict(counts or {})
        obj.extras = dict(extras or {})
        return obj


# what a metric name may hold (MLflow's rule); a dict return's key is written with anything else replaced by '_'
_METRIC_UNSAFE = re.compile(r"[^A-Za-z0-9_./ -]+")


def call_once(fn: RewardFn, response: str, label: str, pass_prompt: bool, prompt: Optional[str]) -> Outcome:
    """Call `fn` once (awaiting it when it is a coroutine function) and check its value; an exception becomes the
    failure's traceback."""
    try:
        value = fn(response, label, prompt=prompt) if pass_prompt else fn(response, label)
        if inspect.isawaitable(value):
            value = _await(value)
        extras = None
        if isinstance(value, dict):
            value, extras = _score_dict(value)
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) and not _is_scalar_number(value):
            raise TypeError(f"returned {type(value).__name__}, expected a float (or a dict with a 'score')")
        counts = getattr(value, "counts", None)
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"returned non-finite {value}")
        counts = counts if isinstance(counts, dict) and counts else None
        return (RewardValue(value, counts, extras) if counts or extras else value), None
    except Exception:
        return None, traceback.format_exc()


def _score_dict(value: dict) -> tuple[Any, dict[str, float]]:
    """(the reward, the other numeric values by key) of verl's `{"score": x, ...}` return; a value that is not a
    finite number (text, a list, NaN) is left out of the metrics, as verl leaves what it cannot average."""
    if "score" not in value:
        raise TypeError(f"returned a dict without a 'score' (keys: {', '.join(map(str, value)) or 'none'}); a dict "
                        "return holds the reward in 'score' and numbers to log under other keys")
    extras = {}
    for key, v in value.items():
        if key == "score":
            continue
        if isinstance(v, bool) or isinstance(v, (int, float)) or _is_scalar_number(v):
            number = float(v)
            if math.isfinite(number):
                extras[_METRIC_UNSAFE.sub("_", str(key)).strip("/") or "_"] = number
    return value["score"], extras


def _await(awaitable: Any) -> Any:
    """The result of an `async def` reward's coroutine: run to its end on a loop of its own, or, where this thread
    already runs a loop (which cannot be re-entered), on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_as_coroutine(awaitable))
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = asyncio.run(_as_coroutine(awaitable))
        except BaseException as exc:  # re-raised in the caller's thread, whose traceback reports it
            box["error"] = exc

    thread = threading.Thread(target=run, name="relax-async-reward")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _as_coroutine(awaitable: Any) -> Any:
    return await awaitable


def _is_scalar_number(value: object) -> bool:
    """numpy scalars and 0-d tensors count as numbers."""
    item = getattr(value, "item", None)
    shape = getattr(value, "shape", None)
    if item is None or shape not in ((), None):
        return False
    try:
        return isinstance(item(), (int, float))
    except Exception:
        return False
