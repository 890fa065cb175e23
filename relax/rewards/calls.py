"""One reward call, checked: the value a reward function returns for a response, or the failure, never raised."""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import Optional

RewardFn = Callable[..., float]


class RewardSpecError(ValueError):
    """`data.reward` names no usable function; raised at start, before any rollout."""


# One call's outcome: (reward, None) or (None, traceback or message of the failure).
Outcome = tuple[Optional[float], Optional[str]]


class RewardValue(float):
    """A reward that also says what its call did: `counts` (name -> number), summed over a batch into
    `Scores.counts` (the `code_tests` reward counts its sandbox runs and their time-outs there). Pickles as a float
    with its counts, so it comes back from a worker process whole."""

    counts: dict[str, float]

    def __new__(cls, value: float, counts: Optional[dict[str, float]] = None) -> RewardValue:
        obj = super().__new__(cls, value)
        obj.counts = dict(counts or {})
        return obj


def call_once(fn: RewardFn, response: str, label: str, pass_prompt: bool, prompt: Optional[str]) -> Outcome:
    """Call `fn` once and check its value; an exception becomes the failure's traceback."""
    try:
        value = fn(response, label, prompt=prompt) if pass_prompt else fn(response, label)
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) and not _is_scalar_number(value):
            raise TypeError(f"returned {type(value).__name__}, expected a float")
        counts = getattr(value, "counts", None)
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"returned non-finite {value}")
        return (RewardValue(value, counts) if isinstance(counts, dict) and counts else value), None
    except Exception:
        return None, traceback.format_exc()


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
