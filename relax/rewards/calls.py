"""One reward call, checked: the value a reward function returns for a response, or the failure, never raised.

What a reward function may return: a number (a float, int, bool, numpy scalar or 0-d tensor); a `RewardValue`
(a float with `counts`, numbers summed over the batch: the code_tests rewards count their sandbox runs there); or
verl's `compute_score` form, a dict `{"score": x, "acc": 1.0, ...}` whose `score` is the reward and whose other
numeric values are logged, each as the batch's mean, rollout/reward/<key>_mean (`RewardValue.extras`). An
`async def` function is awaited here, in the process that makes the call (a reward worker when
`data.reward_timeout_s` is set, whose time limit covers the whole coroutine).

What a reward function receives is decided by its parameters' names (`reward_inputs`, once, when it is named): the
response (a parameter named `response`, `solution_str` as verl names it, or `completion`; otherwise its first
positional parameter) and the label (`label`, verl's `ground_truth`; otherwise the next positional parameter);
`prompt`, the prompt text the model saw (after the chat template; an image is its placeholder text there);
`messages`, the prompt as chat messages (an episode: its whole conversation; each image an OpenAI `image_url` part
with a PNG data URL); and any other name, the data record's field of that name (verl's `data_source`,
`extra_info`; TRL's dataset columns). A `**kwargs` parameter receives `prompt`, `messages` and every field. The
values travel to the reward worker processes with the call (plain data, pickled).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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


# parameter names whose values Relax gives (`reward_inputs`): a record field of one of these names is not passed
RESPONSE_NAMES = ("response", "solution_str", "completion")
LABEL_NAMES = ("label", "ground_truth")
PROMPT, MESSAGES = "prompt", "messages"
GIVEN_NAMES = frozenset(RESPONSE_NAMES + LABEL_NAMES + (PROMPT, MESSAGES))


@dataclass(frozen=True)
class RewardContext:
    """What a response's reward may ask for besides the response and the label: the prompt text (after the chat
    template), the prompt's chat messages (an episode: its conversation; None: unknown), and the data record's other
    fields (`relax.data.datasets.PromptItem.fields`)."""

    prompt: Optional[str] = None
    messages: Optional[list[dict]] = None
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardInputs:
    """How a reward function is called (`reward_inputs`): `positional`, what its leading positional parameters
    receive ("response", "label"); `named`, (parameter, what it receives) for the others: "response", "label",
    `PROMPT`, `MESSAGES` or a record field's name; `optional`, the named parameters with a default (a record without
    that field leaves it out); `rest`, whether a `**kwargs` receives the prompt, messages and every other field."""

    positional: tuple[str, ...] = ("response", "label")
    named: tuple[tuple[str, str], ...] = ()
    optional: frozenset[str] = frozenset()
    rest: bool = False

    @property
    def fields(self) -> list[str]:
        """The record fields asked for by name."""
        return [what for _, what in self.named if what not in GIVEN_NAMES]

    @property
    def required_fields(self) -> list[str]:
        """The record fields asked for by a parameter without a default: a record must have each."""
        return [what for name, what in self.named if what not in GIVEN_NAMES and name not in self.optional]

    def arguments(self, response: str, label: str, context: Optional[RewardContext] = None) \
            -> tuple[tuple, dict[str, Any]]:
        """(positional, keyword) arguments of one call. A field the record lacks is left out (a parameter with a
        default keeps it; one without fails the call, which `check_record_fields` refuses before a start)."""
        context = context or RewardContext()
        given = {"response": response, "label": label, PROMPT: context.prompt, MESSAGES: context.messages}
        args = tuple(given[what] for what in self.positional)
        kwargs: dict[str, Any] = {}
        for name, what in self.named:
            if what in given:
                kwargs[name] = given[what]
            elif what in context.fields:
                kwargs[name] = context.fields[what]
        if self.rest:
            for key in (PROMPT, MESSAGES):
                kwargs.setdefault(key, given[key])
            for key, value in context.fields.items():
                if key not in GIVEN_NAMES:
                    kwargs.setdefault(key, value)
        return args, kwargs


def reward_inputs(fn: RewardFn, signature: Optional[inspect.Signature] = None) -> RewardInputs:
    """How `fn` is called, by its parameters' names (see the module docstring); ValueError when no parameter can take
    the response or the label. A callable without a signature (a builtin) is called as fn(response, label)."""
    if signature is None:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            return RewardInputs()
    params = [p for p in signature.parameters.values()
              if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    rest = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    by_name = [p for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY]
    response = next((p for p in by_name if p.name in RESPONSE_NAMES), None)
    label = next((p for p in by_name if p.name in LABEL_NAMES), None)
    # the first positional parameters no name claims take the response, then the label: fn(text, answer)
    free = [p for p in params if p.kind in positional_kinds and p not in (response, label)
            and p.name not in GIVEN_NAMES]
    if response is None and free:
        response = free.pop(0)
    if label is None and free:
        label = free.pop(0)
    lead = [p for p in params if p.kind in positional_kinds]
    if (response is None or label is None) and len(lead) < 2 and \
            any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
        # fn(*args), fn(response, *args): the response and the label go positionally, as they always did
        named = [(p.name, p.name) for p in params if p not in lead]
        optional = frozenset(p.name for p in params if p.default is not inspect.Parameter.empty)
        return RewardInputs(("response", "label"), tuple(named), optional, rest)
    if response is None:
        raise ValueError("no parameter takes the response (name it response or solution_str, or make it the "
                         "first)")
    if label is None:
        raise ValueError("no parameter takes the label (name it label or ground_truth, or make it the second "
                         "positional parameter)")
    # positional-only parameters (def f(a, b, /)) are passed in order, and can only be the response and the label
    positional: list[str] = []
    for p in params:
        if p.kind is not inspect.Parameter.POSITIONAL_ONLY:
            break
        if p is not (response if not positional else label) or len(positional) == 2:
            raise ValueError(f"the positional-only parameter {p.name!r} can only take the response or the label")
        positional.append("response" if p is response else "label")
    named = [(p.name, "response" if p is response else "label" if p is label else p.name)
             for p in params[len(positional):]]
    optional = frozenset(p.name for p in params if p.default is not inspect.Parameter.empty)
    return RewardInputs(tuple(positional), tuple(named), optional, rest)


def call_once(fn: RewardFn, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Outcome:
    """Call `fn(*args, **kwargs)` once (`RewardInputs.arguments`; awaiting it when it is a coroutine function) and
    check its value; an exception becomes the failure's traceback."""
    try:
        value = fn(*args, **kwargs)
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
