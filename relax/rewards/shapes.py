"""Reward of the `shapes` image task (`relax.data.shapes`): name the shape's colour.

0.5 * (share of the response's words that are colour names) + 0.5 * (the first word is the label). A policy that
always answers some colour without looking earns 0.5 + 0.5 / 4 = 0.625 on average (four colours, uniform); only
reading the image earns 1.
"""

from __future__ import annotations

import re

COLOUR_WORDS = ("red", "green", "blue", "yellow")
_WORD = re.compile(r"[A-Za-z]+|\d|[^\sA-Za-z\d]")


def shapes_reward(response: str, label: str) -> float:
    """See the module docstring; 0 for an empty response."""
    words = _WORD.findall(response)
    if not words:
        return 0.0
    colour_share = sum(w in COLOUR_WORDS for w in words) / len(words)
    return 0.5 * colour_share + 0.5 * float(words[0] == label.strip())
