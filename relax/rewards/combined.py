"""Several rewards: `data.reward=[math, my_rewards:fmt]` with `data.reward_weights=[1.0, 0.2]` (TRL's
`reward_funcs` and `reward_weights`; verl's and slime's custom reward managers).

Each entry is what one `data.reward` is (a built-in name, `package.module:function`, an http(s) reward service),
called as it would be alone: in the reward workers under `data.reward_timeout_s`, or batched through its service.
A response's reward is the weighted sum of its entries' rewards; when any entry's call fails, the response fails as
one failed call does (its group is left out). Each entry's rewards are kept per response in `Scores.extras`, so
that its mean is logged (rollout/reward/<name>_mean, `relax.metrics.reward_mean`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from relax.config.reward_list_rules import component_names
from relax.metrics import REWARD_PARTS_PREFIX, reward_mean
from relax.rewards.calls import RewardContext, RewardFn, RewardSpecError
from relax.rewards.registry import Scores, get_reward_fn, score_responses
from relax.rewards.remote import RemoteReward


@dataclass
class RewardList:
    """The rewards of a list `data.reward`: each entry's spec, its metric name (`component_names`) and function."""

    specs: list[str]
    names: list[str]
    fns: list[RewardFn]

    @property
    def __name__(self) -> str:  # what messages (a worker-pickling check) name it by
        return f"data.reward={self.specs}"

    def __reduce__(self) -> tuple:
        # The functions travel as themselves (pickling the list checks each can reach a worker process); a service's
        # client, which holds a lock, is made again from its URL.
        return (_rebuild, (self.specs, self.names, [None if isinstance(f, RemoteReward) else f for f in self.fns]))


def _rebuild(specs: list[str], names: list[str], fns: list[Optional[RewardFn]]) -> RewardList:
    # (only services are made again: the code_tests rewards travel with their data.sandbox limits)
    return RewardList(list(specs), list(names),
                      [get_reward_fn(s) if f is None else f for s, f in zip(specs, fns, strict=True)])


def reward_of(spec: Any, sandbox: Any = None) -> RewardFn | RewardList:
    """The reward `data.reward` names: one entry's function (`get_reward_fn`), or a `RewardList` for a list;
    `sandbox` (`data.sandbox`): the code_tests rewards' limits."""
    if not isinstance(spec, str) and isinstance(spec, Sequence):
        return reward_list(spec, sandbox)
    return get_reward_fn(spec, sandbox)


def reward_list(specs: Sequence[Any], sandbox: Any = None) -> RewardList:
    """The functions of a list `data.reward`; RewardSpecError naming every entry that cannot be used (each reported
    as `get_reward_fn` reports one), at start."""
    specs = [s.strip() if isinstance(s, str) else s for s in specs]
    if not specs:
        raise RewardSpecError("data.reward=[] names no reward")
    fns, problems = [], []
    for spec in specs:
        try:
            fns.append(get_reward_fn(spec, sandbox))
        except RewardSpecError as exc:
            problems.append(str(exc))
    if problems:
        raise RewardSpecError("\n".join(problems) if len(problems) == 1 else
                              f"data.reward={specs}: {len(problems)} entries cannot be used:\n" +
                              "\n".join(f"  - {p}" for p in problems))
    return RewardList(list(specs), component_names(specs), fns)


def score_list(rewards: RewardList, weights: Optional[Sequence[float]], responses: Sequence[str],
               labels: Sequence[str], prompts: Optional[Sequence[str]] = None, *, timeout_s: Optional[float] = None,
               service_options: Any = None, contexts: Optional[Sequence[RewardContext]] = None,
               workers: Optional[int] = None, memory_mb: Optional[int] = None,
               cancel: Optional[threading.Event] = None) -> Scores:
    """Score each response with every entry (`score_responses`, each entry as it is scored alone) and add the
    rewards up by `weights` (None: 1.0 each). A response fails when any entry's call failed (its reward is then the
    0.0 placeholder); time-outs and counts add up; the first error is the first failing entry's. `Scores.extras`
    holds each entry's rewards (NaN where its call failed) and its dict returns' other keys, as <name>/<key>.
    `service_options` (`data.reward_service`) go to the entries that are services; `contexts`, what each entry's
    parameters ask for (`score_responses`); `workers`, `data.reward_workers`; `memory_mb`, `data.reward_memory_mb`;
    `cancel` stops the calls in worker processes (`score_responses`)."""
    weights = [1.0] * len(rewards.fns) if weights is None else [float(w) for w in weights]
    if len(weights) != len(rewards.fns):
        raise ValueError(f"score_list: {len(weights)} weights for {len(rewards.fns)} rewards")
    parts = []
    for fn in rewards.fns:
        if isinstance(fn, RemoteReward) and service_options is not None:
            fn.options = service_options
        parts.append(score_responses(fn, responses, labels, prompts, timeout_s=timeout_s, contexts=contexts,
                                     workers=workers, memory_mb=memory_mb, cancel=cancel))
    out = Scores()
    for i in range(len(responses)):
        failed = any(p.failed[i] for p in parts)
        out.failed.append(failed)
        out.rewards.append(0.0 if failed else math.fsum(w * p.rewards[i] for w, p in zip(weights, parts,
                                                                                           strict=True)))
    for name, part in zip(rewards.names, parts, strict=True):
        out.timeouts += part.timeouts
        for key, n in part.counts.items():
            out.counts[key] = out.counts.get(key, 0) + n
        if out.first_error is None:
            out.first_error = part.first_error
        out.extras[reward_mean(name)] = [math.nan if bad else r for r, bad in zip(part.rewards, part.failed,
                                                                                   strict=True)]
        for key, values in part.extras.items():
            inner = key[len(REWARD_PARTS_PREFIX):-len("_mean")]
            out.extras[reward_mean(f"{name}/{inner}")] = values
    return out
