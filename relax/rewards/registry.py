"""Choosing a reward function by name and scoring responses robustly.

A reward function is `fn(response: str, label: str) -> float` (higher is better, typically in [0, 1]);
it may also accept a `prompt` keyword argument (the prompt text), which it then receives. Built-ins:
`digits`, `arithmetic`, `math`; any other function is named by import path `package.module:function`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from relax.rewards.digits import digits_reward
from relax.rewards.math_reward import arithmetic_reward, math_reward

RewardFn = Callable[..., float]
logger = logging.getLogger(__name__)

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "digits": digits_reward,
    "arithmetic": arithmetic_reward,
    "math": math_reward,
}


class RewardSpecError(ValueError):
    """`data.reward` names no usable function; raised at start, before any rollout."""


def get_reward_fn(spec: str) -> RewardFn:
    """The reward function named by `spec`: a built-in name or `package.module:function`.

    Import problems are reported here, at start, rather than on the first rollout.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(f"data.reward={spec!r}: expected one of {sorted(BUILTIN_REWARDS)} or "
                              "'package.module:function'")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise RewardSpecError(f"data.reward={spec!r}: unknown reward; expected one of {sorted(BUILTIN_REWARDS)} "
                              "or an import path 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or an error raised while importing the user's module
        raise RewardSpecError(f"data.reward={spec!r}: cannot import module {module_name!r}: "
                              f"{type(e).__name__}: {e}") from e
    fn = module
    for part in attr.split("."):
        if not part or not hasattr(fn, part):
            raise RewardSpecError(f"data.reward={spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardSpecError(f"data.reward={spec!r}: {attr!r} is not callable")
    return fn


def accepts_prompt(fn: RewardFn) -> bool:
    """Whether `fn` takes a `prompt` keyword (or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "prompt" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@dataclass
class Scores:
    """Rewards of a batch of responses. A failed call (it raised, or returned a non-number or a non-finite
    value) has `failed[i]` True and `rewards[i]` 0.0, a placeholder that must never be trained on as real."""

    rewards: list[float] = field(default_factory=list)
    failed: list[bool] = field(default_factory=list)
    first_error: Optional[str] = None  # the traceback of the first failure

    @property
    def errors(self) -> int:
        return sum(self.failed)


def score_responses(
    fn: RewardFn,
    responses: Sequence[str],
    labels: Sequence[str],
    prompts: Optional[Sequence[str]] = None,
) -> Scores:
    """Score each (response, label) pair; a failing call is recorded in `Scores.failed`, never raised.

    `prompts` are passed as `prompt=` to functions that accept it (`accepts_prompt`).
    """
    if len(responses) != len(labels):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(labels)} labels")
    if prompts is not None and len(prompts) != len(responses):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(prompts)} prompts")
    pass_prompt = prompts is not None and accepts_prompt(fn)
    out = Scores()
    for i, (response, label) in enumerate(zip(responses, labels, strict=True)):
        try:
            value = fn(response, label, prompt=prompts[i]) if pass_prompt else fn(response, label)
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, (int, float)) and not _is_scalar_number(value):
                raise TypeError(f"returned {type(value).__name__}, expected a float")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned non-finite {value}")
            out.rewards.append(value)
            out.failed.append(False)
        except Exception as e:
            if out.first_error is None:
                out.first_error = traceback.format_exc()
                logger.warning("reward function %s failed on a response (its group is left out of the loss): "
                               "%s: %s", getattr(fn, "__name__", fn), type(e).__name__, e)
            out.rewards.append(0.0)
            out.failed.append(True)
    return out


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
