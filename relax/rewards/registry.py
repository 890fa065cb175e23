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
from collections.abc import Callable, Sequence
from typing import Optional

from relax.metrics import REWARD_ERRORS
from relax.rewards.digits import digits_reward
from relax.rewards.math_reward import arithmetic_reward, math_reward

RewardFn = Callable[..., float]
logger = logging.getLogger(__name__)

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "digits": digits_reward,
    "arithmetic": arithmetic_reward,
    "math": math_reward,
}

# Metric name of the count of failed reward calls (an exception, a non-number or a non-finite value).
REWARD_ERRORS_METRIC = REWARD_ERRORS


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


def score_responses(
    fn: RewardFn,
    responses: Sequence[str],
    labels: Sequence[str],
    prompts: Optional[Sequence[str]] = None,
) -> tuple[list[float], int]:
    """Score each (response, label) pair; returns (rewards, n_errors).

    A call that raises, or returns a non-number (bool counts as a number) or a non-finite value, scores 0.0
    and is counted in n_errors (reported as `rollout/reward_errors`): one bad sample never kills the run.
    `prompts` are passed as `prompt=` to functions that accept it.
    """
    if len(responses) != len(labels):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(labels)} labels")
    if prompts is not None and len(prompts) != len(responses):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(prompts)} prompts")
    pass_prompt = prompts is not None and accepts_prompt(fn)
    rewards: list[float] = []
    n_errors = 0
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
        except Exception as e:
            n_errors += 1
            if n_errors == 1:
                logger.warning("reward function %s failed (scored 0): %s: %s", getattr(fn, "__name__", fn),
                               type(e).__name__, e)
            value = 0.0
        rewards.append(value)
    return rewards, n_errors


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
