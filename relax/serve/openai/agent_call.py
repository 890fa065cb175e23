"""One agent run in a worker process (`relax.rewards.worker_pool`): the caller the agent workers unpickle, in a
module of its own so that each worker imports only this and the agent's own module, not the gateway and torch
(`relax.serve.openai.agents` imports them: seconds of CPU per worker, and a hung agent's worker is replaced)."""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import Any, Optional


def call_agent(fn: Callable[..., Any], item: dict, base_url: str,
               api_key: str) -> tuple[Optional[float], Optional[str]]:
    """One agent run (the worker processes' caller): (reward or None, None), or (None, the error)."""
    try:
        value = fn(item, base_url, api_key)
    except Exception:
        lines = traceback.format_exc().strip().splitlines()
        return None, "the agent raised: " + "\n".join(lines[-12:])
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, f"the agent returned {value!r}: expected a finite number or None"
    return float(value), None
