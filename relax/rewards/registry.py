"""Choosing a reward function by name and scoring responses robustly.

A reward function is `fn(response: str, label: str) -> float` (higher is better, typically in [0, 1]); what else it
receives its parameters' names decide (`relax.rewards.calls.reward_inputs`): `prompt` (the prompt text after the chat
template), `messages` (the prompt's chat messages; an episode's conversation), and any other name the data record's
field of that name (verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` works as it is). A
required parameter that names a field some record lacks is refused before the start (`check_record_fields`). It is
called once per response: a batched function (`responses`, `completions`, `labels`: lists) is refused at start.
Built-ins: `digits`, `arithmetic`, `math`; any other function is named by import path `package.module:function`, or by
its file, `/path/to/file.py:function` (verl's `custom_reward_function.path`): the file's directory is appended to
`sys.path` and the file imported as the module of its name, so that the reward worker processes (which get the driver's
`sys.path`) import it by that name as they import any other.

Time limit (`score_responses(..., timeout_s=...)`, `data.reward_timeout_s`): a call that takes longer fails like
one that raised. A hung call cannot be stopped inside a thread (and a regex or C extension stuck in a loop holds
the GIL, so not even the thread that waits for it would run), so limited calls run in worker processes
(`relax.rewards.worker_pool.RewardWorkers`, spawned once and reused): a call still running `timeout_s` after it
started has its process killed and replaced. The function travels to the workers by pickle (by reference for
module-level functions). A function may carry a `prepare` attribute, a callable without arguments that each
worker runs once after loading it, before its first call's time is counted (heavy imports, warm-up: the math
rewards import math-verify there).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import re
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from relax.imports import resolve_component
from relax.metrics import reward_mean
from relax.rewards.calls import RewardContext, RewardFn, RewardInputs, RewardSpecError, call_once, reward_inputs
from relax.rewards.code_tests import CodeTestsReward, code_tests_all_reward, code_tests_reward
from relax.rewards.digits import digits_reward
from relax.rewards.math_reward import arithmetic_reward, math_reward
from relax.rewards.remote import RemoteReward, is_url
from relax.rewards.shapes import shapes_reward
from relax.rewards.worker_pool import POOL_LOCK, workers_for

logger = logging.getLogger(__name__)

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "digits": digits_reward,
    "arithmetic": arithmetic_reward,
    "math": math_reward,
    "code_tests": code_tests_reward,  # the share of unit tests the response's code passes in the sandbox
    "code_tests_all": code_tests_all_reward,  # 1 when it passes all of them
    "shapes": shapes_reward,
}


def get_reward_fn(spec: str, sandbox: Any = None) -> RewardFn:
    """The reward function named by `spec`: a built-in name or `package.module:function`, or a reward service's
    client (`relax.rewards.remote.RemoteReward`, called batched in this process) for an http(s) URL. `sandbox`
    (`data.sandbox`): the code_tests rewards' limits (None: the defaults).

    Import problems are reported here, at start, rather than on the first rollout. One entry: a list `data.reward`
    is `relax.rewards.combined.reward_of`'s, which builds each entry here.
    """
    if is_url(spec):
        try:
            return RemoteReward(spec.strip())
        except ValueError as exc:
            raise RewardSpecError(str(exc)) from None
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(f"data.reward={spec!r}: expected one of {sorted(BUILTIN_REWARDS)} or "
                              "'package.module:function'")
    spec = spec.strip()
    if sandbox is not None and spec in ("code_tests", "code_tests_all"):
        return CodeTestsReward.for_config(spec, sandbox)
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", spec)
    if scheme:
        raise RewardSpecError(f"data.reward={spec!r}: only http:// and https:// URLs are reward services; a "
                              f"{scheme.group(1)}:// URL is neither a service nor a function (a function is named "
                              "'package.module:function' or '/path/to/file.py:function')")
    if ":" not in spec and (spec.endswith(".py") or "/" in spec):  # verl's custom_reward_function.path, alone
        raise RewardSpecError(f"data.reward={spec!r}: a reward named by its file needs the function's name too: "
                              f"data.reward=<path>:function, e.g. data.reward={spec}:compute_score (the name verl "
                              "calls by default)")
    target = _import_file(spec) if _names_a_file(spec) else spec
    fn = resolve_component(BUILTIN_REWARDS, "data.reward", target, error=RewardSpecError,
                           unknown="{option}={spec!r}: unknown reward; expected one of {builtins} "
                                   "or an import path 'package.module:function'",
                           keep_cause=True)
    if not callable(fn):
        raise RewardSpecError(f"data.reward={spec!r}: {spec.partition(':')[2]!r} is not callable")
    _check_signature(spec, fn)
    return fn


def _names_a_file(spec: str) -> bool:
    """Whether `spec` names a function by its file (`/path/to/file.py:function`, `rewards/mine.py:fn`) rather than
    by module (`package.module:function`)."""
    where = spec.rpartition(":")[0]
    return "/" in where or (where.endswith(".py") and Path(where).expanduser().is_file())  # (not a module a.py)


def _import_file(spec: str) -> str:
    """Make the file of `spec` (`path.py:function`) importable under its name and return `module:function`: its
    directory is appended to `sys.path` (last, so that it shadows nothing), which reward worker processes receive.
    RewardSpecError for a missing file, a name that is no module name, or one that another module already has."""
    where, _, attr = spec.rpartition(":")
    path = Path(where).expanduser().resolve()
    if path.suffix != ".py":
        raise RewardSpecError(f"data.reward={spec!r}: a reward named by its file needs a .py file "
                              "('/path/to/file.py:function'), or name it by module: 'package.module:function'")
    if not path.is_file():
        raise RewardSpecError(f"data.reward={spec!r}: no such file {path}")
    name = path.stem
    if not name.isidentifier():
        raise RewardSpecError(f"data.reward={spec!r}: {path.name} is imported as a module named by the file, and "
                              f"{name!r} is no Python module name: rename the file (letters, digits, _)")
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.append(directory)
        importlib.invalidate_caches()
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    if origin is None or Path(origin).resolve() != path:
        raise RewardSpecError(f"data.reward={spec!r}: the file is imported as the module {name!r}, and that name is "
                              f"already taken by {origin or 'another module'}: rename {path.name}")
    return f"{name}:{attr}"


# parameter names of batched reward functions (TRL's reward_funcs, verl's batched compute_score): lists, one item per
# response, where Relax passes one response and its label
BATCHED_NAMES = ("responses", "completions", "labels", "prompts", "solution_strs", "ground_truths")


def _check_signature(spec: str, fn: RewardFn) -> None:
    """RewardSpecError when `fn` cannot be called as the run calls it (no parameter takes the response or the label:
    `reward_inputs`), or is written for batches (a parameter named as TRL and verl name batches: `BATCHED_NAMES`):
    otherwise every call would fail, each group left out, and the run would train nothing."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension without a signature: its first call will tell
        return
    batched = [p.name for p in signature.parameters.values() if p.name in BATCHED_NAMES]
    if batched:
        wrapper, notes = batched_wrapper(fn, signature)
        raise RewardSpecError(f"data.reward={spec!r}: {spec}{signature} looks batched (its parameter {batched[0]!r} "
                              "names a list, as TRL's and verl's batched reward functions do), and Relax calls a "
                              "reward function once per response: fn(response, label) -> float, with the prompt, "
                              "the messages and the data record's other fields passed by their parameters' names "
                              f"(all of them to a **kwargs). Wrap it (beside it, or importing it): {wrapper}"
                              + "".join(f"; {note}" for note in notes))
    try:
        reward_inputs(fn, signature)
    except ValueError as exc:
        raise RewardSpecError(f"data.reward={spec!r}: cannot be called as fn(response, label): {exc}; a reward "
                              f"function takes the response text and the label (and, by their names, `prompt`, "
                              f"`messages` and the data record's fields), and returns a float: {spec}{signature}") \
            from None


# a batched function's list parameters (`BATCHED_NAMES`, verl's batched compute_score's) -> what the wrapper
# `batched_wrapper` writes puts in each list: the wrapper's parameter of that name (the response, the label, the prompt
# or a record field)
_BATCH_ITEMS = {"responses": "completion", "completions": "completion", "solution_strs": "completion",
                "labels": "label", "ground_truths": "label", "prompts": "prompt",
                "data_sources": "data_source", "extra_infos": "extra_info"}
# what TRL passes a reward function besides the data set's columns and the lists above, and Relax has no value for
TRL_ARGUMENTS = ("completion_ids", "trainer_state")


def batched_wrapper(fn: RewardFn, signature: inspect.Signature) -> tuple[str, list[str]]:
    """(the one-line per-response reward that calls the batched `fn` as TRL or verl calls it, with one-item lists;
    what the message says about it). The wrapper is `reward(completion, label, <record fields>, **fields)`: the run
    gives its `**fields` the prompt, the messages and the record's fields (the label's column is not among them: it
    is `label`). Each parameter of `fn`:
    - a list parameter (`_BATCH_ITEMS`) gets its item: the response, the label, the prompt or a record field;
    - any other with a default is left out: its default applies (a field of its name still reaches a **kwargs);
    - TRL's own `TRL_ARGUMENTS` get None (and a note): Relax has no token ids or trainer state;
    - the first other one, when no list parameter took the label, gets the record's field of its name or, where the
      record has none (data.label_key names that column), the label: TRL's `solution` in `(completions, solution,
      **kwargs)`; any other one, the record's field of its name.
    A **kwargs gets the fields no parameter was given, and `label=` when no parameter took the label (TRL's
    `(completions, **kwargs)`, which reads the label's column from kwargs under the column's name)."""
    name = getattr(fn, "__name__", "fn")
    labelled = any(_BATCH_ITEMS.get(p.name) == "label" for p in signature.parameters.values())
    own: dict[str, str] = {}  # the wrapper's parameters besides completion and label -> "" or "=None" (a default)
    args: dict[str, str] = {}  # fn's parameter -> what it is passed
    notes = []
    for p in signature.parameters.values():
        item = _BATCH_ITEMS.get(p.name)
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) or \
                (item is None and p.default is not inspect.Parameter.empty):
            continue
        if p.name in TRL_ARGUMENTS:
            args[p.name] = "None"
            notes.append(f"Relax has no {p.name} to give (a reward function gets the text of one response), so the "
                         f"wrapper passes {p.name}=None: if {name} reads it, it cannot be wrapped as it is")
        elif item is None and not labelled:
            args[p.name], labelled = f"[fields.get({p.name!r}, label)]", True
        else:
            item = item or p.name
            args[p.name] = f"[{item}]"
            if item not in ("completion", "label"):
                own[item] = "" if p.default is inspect.Parameter.empty else own.get(item, "=None")
    positional = {p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY}
    passed = [v if k in positional else f"{k}={v}" for k, v in args.items()]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        if not labelled:
            args["label"] = "[label]"
            passed.append("label=[label]")
            notes.append("TRL passes each data set column, the label's too, as a keyword named as the column: "
                         "label=[label] is data.label_key's default column; with another, write its name there "
                         "(solution=[label] with data.label_key=solution)")
        passed.append(f"**{{k: [v] for k, v in fields.items() if k not in {tuple(args)!r}}}")
    params = ["completion", "label", *(k for k, d in own.items() if not d), *(k + d for k, d in own.items() if d),
              "**fields"]
    wrapper, call = f"reward({', '.join(params)})", f"{name}({', '.join(passed)})"
    if inspect.iscoroutinefunction(fn):
        return f"async def {wrapper}: return (await {call})[0]", notes
    return f"def {wrapper}: return {call}[0]", notes


def check_record_fields(spec: object, fn: RewardFn, items: Sequence[object], what: str) -> None:
    """RewardSpecError naming the parameter, when `fn` (a `data.reward` entry) asks, by a parameter without a default,
    for a record field that an item of `items` (prompt items of the data set `what`) lacks: every such call would fail.
    Items without fields (a synthetic task's) have none."""
    try:
        inputs = reward_inputs(fn)
    except ValueError:  # (get_reward_fn refused it already)
        return
    for name in inputs.required_fields:
        missing = next((item for item in items if name not in (getattr(item, "fields", None) or {})), None)
        if missing is not None:
            where = getattr(missing, "source", "") or f"item {getattr(missing, 'index', '?')}"
            have = sorted(getattr(missing, "fields", None) or {})
            raise RewardSpecError(
                f"data.reward={spec!r}: its parameter {name!r} asks for the data record's field {name!r}, and "
                f"{what}'s record {where} has none (its other fields: {', '.join(have) or 'none'}); name an "
                f"existing field, give the parameter a default, or add the field (a reward's parameters: the "
                f"response, the label, prompt, messages and record fields)")


def accepts_prompt(fn: RewardFn) -> bool:
    """Whether `fn` takes a `prompt` keyword (or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "prompt" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@dataclass
class Scores:
    """Rewards of a batch of responses. A failed call (it raised, returned a non-number or a non-finite value, or
    ran past its time limit) has `failed[i]` True and `rewards[i]` 0.0, a placeholder that must never be trained on
    as real."""

    rewards: list[float] = field(default_factory=list)
    failed: list[bool] = field(default_factory=list)
    first_error: Optional[str] = None  # the traceback (or time-out message) of the first failure
    timeouts: int = 0  # failed calls that ran past the time limit
    # reward_model=classifier|judge (relax.runner.reward_model): its score of each response (NaN: none), the
    # judge's answers without a readable score, and the seconds the batch took in it; None / 0 without one
    model_scores: Optional[list[float]] = None
    parse_failures: int = 0
    model_time: float = 0.0
    # what the calls counted (`relax.rewards.calls.RewardValue.counts`, summed): the code_tests rewards' sandbox_runs
    # and sandbox_timeouts
    counts: dict[str, float] = field(default_factory=dict)
    # numbers logged as their mean over the scored responses, metric name -> one value per response (NaN: none): a
    # dict return's other keys (`RewardValue.extras`), a list data.reward's components, the rule reward before a
    # reward model's score is added (`relax.runner.rollout_driver.scoring.extra_metrics`)
    extras: dict[str, list[float]] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        return sum(self.failed)


def score_responses(
    fn: RewardFn,
    responses: Sequence[str],
    labels: Sequence[str],
    prompts: Optional[Sequence[str]] = None,
    *,
    timeout_s: Optional[float] = None,
    contexts: Optional[Sequence[RewardContext]] = None,
    workers: Optional[int] = None,
    memory_mb: Optional[int] = None,
    cancel: Optional[threading.Event] = None,
) -> Scores:
    """Score each (response, label) pair; a failing call is recorded in `Scores.failed`, never raised.

    `contexts` (one per response: its prompt, messages and record fields) give what `fn`'s parameters ask for
    (`relax.rewards.calls.reward_inputs`); without them, `prompts` are the prompts. `timeout_s`: None calls `fn`
    here, one call after the other; a number runs the calls in worker processes (`RewardWorkers`: `workers` of them,
    `data.reward_workers`; None: as many as the CPUs, at most 4), where a call that takes longer fails (and its
    process is replaced), as does one that allocates past `memory_mb` (`data.reward_memory_mb`, each worker's
    memory limit; None: none; only with `timeout_s`: the driver's own memory is never limited). `cancel`, set by
    another thread (then `relax.rewards.worker_pool.wake_calls`), stops the calls in worker processes: CallsCancelled.
    """
    if len(responses) != len(labels):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(labels)} labels")
    if prompts is not None and len(prompts) != len(responses):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(prompts)} prompts")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"score_responses: timeout_s={timeout_s} must be > 0 (or None: no limit)")
    if memory_mb is not None and timeout_s is None:
        raise ValueError(f"score_responses: memory_mb={memory_mb} limits the worker processes, and timeout_s=None "
                         "calls the function here")
    if isinstance(fn, RemoteReward):  # batched requests from here, with their own limits (data.reward_service)
        values, errors, timed_out = fn.score_batch(responses, labels, prompts, contexts)
        return _scores(fn, list(zip(values, errors, strict=True)), timed_out)
    if contexts is None:
        contexts = [RewardContext(prompt=None if prompts is None else prompts[i]) for i in range(len(responses))]
    elif len(contexts) != len(responses):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(contexts)} contexts")
    try:
        inputs = reward_inputs(fn)
    except ValueError:  # (get_reward_fn refuses it) a function given here directly: each call fails, and says why
        inputs = RewardInputs()
    calls = [inputs.arguments(r, lab, c) for r, lab, c in zip(responses, labels, contexts, strict=True)]
    if timeout_s is None:
        outcomes = [call_once(fn, *c) for c in calls]
        timed_out = [False] * len(calls)
    else:
        with POOL_LOCK:
            outcomes, timed_out = workers_for(fn, workers, memory_mb).run(calls, timeout_s, cancel)
    return _scores(fn, outcomes, timed_out)


def _scores(fn: RewardFn, outcomes: Sequence[tuple], timed_out: Sequence[bool]) -> Scores:
    out = Scores()
    for (value, error), late in zip(outcomes, timed_out, strict=True):
        for name, n in getattr(value, "counts", {}).items():
            out.counts[name] = out.counts.get(name, 0) + n
        out.rewards.append(0.0 if value is None else float(value))
        out.failed.append(value is None)
        out.timeouts += int(late)
        if value is None and out.first_error is None:
            out.first_error = error
            warn_failed_score(f"reward function {getattr(fn, '__name__', fn)}", error)
    keys = sorted({k for value, _ in outcomes for k in getattr(value, "extras", {})})
    out.extras = {reward_mean(k): [getattr(v, "extras", {}).get(k, float("nan")) for v, _ in outcomes] for k in keys}
    return out


def warn_failed_score(what: str, error: Optional[str], on: str = "a response") -> None:
    """The console's warning of a batch's first failed score, one per batch and scorer (data.reward's calls here, the
    reward model's and the episodes' (data.openai_agent, data.env, data.agent) in
    `relax.runner.rollout_driver.scoring`): what failed, on what (`on`), that the groups are left out, and the last
    line of its error (a traceback's is its exception)."""
    last_line = (error or "").strip().splitlines()[-1:] or ["?"]
    if on == "a response":
        logger.warning("%s failed on a response (its group is left out of the loss): %s", what, last_line[0])
    else:
        logger.warning("%s failed on %s (their groups are left out of the loss); the first failure: %s", what, on,
                       last_line[0])
