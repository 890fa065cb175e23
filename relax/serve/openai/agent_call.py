"""One agent run in a worker process (`relax.rewards.worker_pool`): the caller the agent workers unpickle, in a
module of its own so that each worker imports only this and the agent's own module, not the gateway and torch
(`relax.serve.openai.agents` imports them: seconds of CPU per worker, and a hung agent's worker is replaced)."""

from __future__ import annotations

import inspect
import math
import traceback
from collections.abc import Callable
from typing import Any, Optional

# The exceptions agent frameworks raise when a run reaches their own turn limit, by class name (the frameworks are
# not imported here): openai-agents' Runner.run(max_turns=), LangGraph's recursion_limit, pydantic-ai's request limit
TURN_LIMIT_EXCEPTIONS = ("MaxTurnsExceeded", "GraphRecursionError", "UsageLimitExceeded")
TURN_LIMIT_ERROR = "the agent stopped at its framework's turn limit: "  # how such an error starts (else: RAISED)
# The exceptions agent frameworks raise on an answer its token limit cut (finish "length"), by class name, each read
# in the framework's code: openai-agents' ModelBehaviorError (a Responses answer `incomplete`, a chat answer cut with
# no text, an output_type's JSON cut short); the openai SDK's LengthFinishReasonError (its parse helpers,
# `chat.completions.parse` and `.stream`, on finish_reason "length"; langchain-openai's `with_structured_output`
# raises it too, by json_schema, its default, and json_mode); pydantic-ai's IncompleteToolCall (a tool call cut by the
# token limit; pydantic_ai/exceptions.py, not installed here). Only these, after a cut last answer, end a run "length"
# (`relax.serve.openai.agents._end_of_run`); any other exception there (the agent's own) fails the run.
CUT_ANSWER_EXCEPTIONS = ("ModelBehaviorError", "LengthFinishReasonError", "IncompleteToolCall")
CUT_ANSWER_ERROR = "the agent raised its framework's error on a model answer: "  # how such an error starts
RAISED = "the agent raised: "


def call_agent(fn: Callable[..., Any], item: dict, base_url: str,
               api_key: str) -> tuple[Optional[float], Optional[str]]:
    """One agent run (the worker processes' caller): (reward or None, None), or (None, the error). An error that
    is one of `TURN_LIMIT_EXCEPTIONS` (a subclass too) starts with `TURN_LIMIT_ERROR`, one of `CUT_ANSWER_EXCEPTIONS`
    with `CUT_ANSWER_ERROR`, any other with `RAISED`."""
    try:
        value = fn(item, base_url, api_key)
    except Exception as exc:
        lines = traceback.format_exc().strip().splitlines()
        names = {c.__name__ for c in type(exc).__mro__}
        prefix = TURN_LIMIT_ERROR if names.intersection(TURN_LIMIT_EXCEPTIONS) \
            else CUT_ANSWER_ERROR if names.intersection(CUT_ANSWER_EXCEPTIONS) else RAISED
        return None, prefix + "\n".join(lines[-12:])
    if value is None:
        return None, None
    if (lazy := _not_run(value)) is not None:
        return None, lazy
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, f"the agent returned {value!r}: expected a finite number or None"
    return float(value), None


def _not_run(value: object) -> Optional[str]:
    """The error for what an agent returned that is work not yet done, a coroutine or generator (closed here, so
    that it warns of nothing), or None. The pre-start check (`relax.serve.openai.agents.load_agent`) refuses async
    and generator functions; this is the one it cannot see: an async function behind a synchronous wrapper (a
    tracing or retry decorator with functools.wraps), which only its call shows."""
    if inspect.isawaitable(value):
        what = "a coroutine" if inspect.iscoroutine(value) else f"an awaitable ({type(value).__name__})"
        if inspect.iscoroutine(value):
            value.close()
        return (f"the agent returned {what}: an agent must be a synchronous function, and Relax calls it in a worker "
                f"process without awaiting what it returns (an async function behind a synchronous decorator "
                f"returns one); run the async part inside it: return asyncio.run(...)")
    if inspect.isgenerator(value) or inspect.isasyncgen(value):
        if inspect.isgenerator(value):
            value.close()
        return (f"the agent returned {'an async generator' if inspect.isasyncgen(value) else 'a generator'}: an "
                f"agent returns its reward (a number or None) and must not yield it")
    return None
