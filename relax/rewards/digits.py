"""Reward of the `digits` task: answer "repeat 7" with "7".

Designed so that a randomly initialised model learns it by RL in a few dozen steps: the reward has partial
credit, and a policy sampling uniformly over the tiny tokenizer's vocabulary already earns about 0.17 on
average (tests/rewards/test_digits.py measures it), so the very first rollouts carry a learning signal.
"""

from __future__ import annotations

import re

# A response is split into units that mirror the tiny tokenizer's pieces: a digit, a run of letters, or
# any other non-space character. Whitespace does not count.
_UNIT = re.compile(r"\d|[A-Za-z]+|[^\sA-Za-z\d]")
MATCH_WINDOW = 4  # K: how many leading units are compared with the label


def response_units(response: str) -> list[str]:
    """The units the digits reward counts (digits, words, symbols; whitespace dropped)."""
    return _UNIT.findall(response)


def digits_reward(response: str, label: str) -> float:
    """0.5 * (share of the response's units that are digits)
    + 0.5 * (share of the first K units equal to the label's digits), in [0, 1].

    Units: single digits, runs of letters, single other characters; whitespace is ignored. The label's
    digits are compared position by position (a one-digit label "7" expects "7" at every compared
    position); K = max(4, len(label digits)) but never more than the number of units, so "7" and "7777"
    both score 1.0, "7 3" scores 0.75, "x" scores 0 and the empty response scores 0.
    """
    units = response_units(response)
    target = [c for c in str(label) if c.isdigit()]
    if not units or not target:
        return 0.0
    digit_share = sum(u.isdigit() for u in units) / len(units)
    k = min(max(MATCH_WINDOW, len(target)), len(units))
    match_share = sum(units[i] == target[i % len(target)] for i in range(k)) / k
    return 0.5 * digit_share + 0.5 * match_share
