"""Several rewards (`data.reward` a list, weighted by `data.reward_weights`) and pass@k's threshold on a reward of no
fixed scale, reported with the rest of the config's rules (`relax.config.validate`).

A list's entries are what one `data.reward` is (a built-in name, `package.module:function`, an http(s) reward
service URL); `none` is the absence of a rule reward and stands alone. The rules of a single string live where
they did (`relax.config.reward_service_rules`, which states them for each entry of a list too). Whether an entry
imports and can be called is checked at start, by preflight (`relax.rewards.combined.reward_list`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from relax.algorithms.base import Violation
from relax.config.credentials import REWARD_KEY_INSTEAD, credentials_problem
from relax.config.evaluation import evaluates
from relax.config.reward_service_rules import is_service
from relax.config.schema import RelaxConfig

_METRIC_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def reward_specs(reward: object) -> list[str]:
    """The entries of `data.reward`: [the string] for one, the list's entries for a list."""
    return [reward] if isinstance(reward, str) else list(reward)  # type: ignore[arg-type]


def is_reward_list(reward: object) -> bool:
    """Whether `data.reward` is the list form (a list of one entry included), whose components are logged."""
    return not isinstance(reward, str)


def _base_name(spec: str) -> str:
    spec = spec.strip()
    if is_service(spec):
        parts = urlsplit(spec)
        name = "_".join(p for p in (parts.hostname or "", str(parts.port or ""), parts.path.strip("/")) if p)
    else:
        name = spec.rpartition(":")[2]
    return _METRIC_UNSAFE.sub("_", name).strip("_") or "reward"


def component_names(specs: Sequence[str]) -> list[str]:
    """The name of each entry of a list `data.reward`, as its metric reads (rollout/reward/<name>_mean): a built-in's
    name, a function's attribute (`my_rewards:fmt` -> fmt), a service's host, port and path; where two entries would
    share a name, each of them is named by its whole spec instead (`my_rewards.fmt`). Equal specs keep equal names
    (the rules refuse a list that holds one twice)."""
    base = [_base_name(s) for s in specs]
    return [b if base.count(b) == 1 else (_METRIC_UNSAFE.sub("_", s.strip().replace(":", ".")).strip("_") or b)
            for s, b in zip(specs, base, strict=True)]


def reward_list_violations(cfg: RelaxConfig) -> list[Violation]:
    """Every broken rule of a list `data.reward` and of `data.reward_weights`, and pass@k's threshold where the
    reward has no fixed scale."""
    d, out = cfg.data, []

    def require(ok: bool, fields: tuple[str, ...] | str, message: str) -> None:
        if not ok:
            out.append(Violation((fields,) if isinstance(fields, str) else tuple(fields), message))

    out.extend(_threshold_violations(cfg))
    if isinstance(d.reward, str):
        require(d.reward_weights is None, ("data.reward_weights", "data.reward"),
                f"data.reward_weights={list(d.reward_weights or [])} weighs the entries of a list data.reward, and "
                f"data.reward={d.reward} is one function (write data.reward=[{d.reward},...] for several)")
        return out
    specs = list(d.reward) if isinstance(d.reward, (list, tuple)) else None
    if specs is None:
        require(False, "data.reward", f"data.reward={d.reward!r}: expected a reward (a name, "
                "package.module:function or an http(s) URL) or a list of them")
        return out
    require(len(specs) > 0, "data.reward", "data.reward=[] names no reward (data.reward=none for no rule reward)")
    bad = [s for s in specs if not isinstance(s, str) or not s.strip()]
    require(not bad, "data.reward", f"data.reward={specs}: each entry must be a reward (a name, "
            f"package.module:function or an http(s) URL); not {', '.join(repr(b) for b in bad)}")
    if bad or not specs:
        return out
    require("none" not in [s.strip() for s in specs], "data.reward",
            f"data.reward={specs}: 'none' means no rule reward and cannot be an entry of a list (leave it out)")
    twice = sorted({s for s in specs if specs.count(s) > 1})
    require(not twice, "data.reward", f"data.reward={specs} lists {', '.join(twice)} more than once (give one entry "
            "the sum of its weights in data.reward_weights)")
    w = d.reward_weights
    if w is not None:
        require(len(w) == len(specs), ("data.reward_weights", "data.reward"),
                f"data.reward_weights={list(w)} has {len(w)} weight(s) and data.reward lists {len(specs)} reward(s): "
                "give one weight per reward, in the same order")
        require(all(math.isfinite(x) for x in w), "data.reward_weights",
                f"data.reward_weights={list(w)}: each weight must be a finite number")
    for i, spec in enumerate(specs):
        problem = credentials_problem(f"data.reward[{i}]", spec, REWARD_KEY_INSTEAD)
        require(problem is None, "data.reward", problem or "")
    return out


def _threshold_violations(cfg: RelaxConfig) -> list[Violation]:
    """pass@k counts a response correct when its reward reaches `train.eval_correct_threshold`, whose default (1.0)
    is a rule reward's full score. With a reward model the reward is rule_weight x data.reward + weight x its score
    (a judge's 0-10, a classifier's logit), and with a list data.reward it is the weighted sum: 1.0 means nothing
    there (a list of one entry at weight 1.0 excepted), so an evaluating run must set the threshold on that scale."""
    t = cfg.train
    if not evaluates(cfg) or t.eval_correct_threshold != type(t)().eval_correct_threshold:
        return []
    rm = cfg.reward_model
    if rm.kind != "none":
        return [Violation(("train.eval_correct_threshold", "reward_model"),
                          f"train.eval_correct_threshold is left at its default ({t.eval_correct_threshold:g}, a rule "
                          f"reward's full score), and with reward_model={rm.kind} the evaluation reward is "
                          f"{'rule_weight x data.reward + ' if cfg.data.reward != 'none' else ''}weight x the model's "
                          "score: set train.eval_correct_threshold to the reward a correct response reaches on that "
                          "scale (pass@k counts a response correct at or above it), or set reward_model=none")]
    d = cfg.data
    if is_reward_list(d.reward) and not (len(d.reward) == 1 and list(d.reward_weights or [1.0]) == [1.0]):
        return [Violation(("train.eval_correct_threshold", "data.reward"),
                          f"train.eval_correct_threshold is left at its default ({t.eval_correct_threshold:g}, one "
                          f"rule reward's full score), and data.reward={list(cfg.data.reward)} is a weighted sum "
                          "(data.reward_weights): set train.eval_correct_threshold to the sum a correct response "
                          "reaches (pass@k counts a response correct at or above it)")]
    return []
