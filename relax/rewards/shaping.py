"""Reward shaping that depends on a response's length, not on its text: DAPO's soft overlong punishment.

Pure functions of numbers (no torch): the runner applies them to the task rewards of a training rollout before the
advantages (`data.overlong_buffer_len`, `data.overlong_penalty_factor`); evaluation scores the task alone.
"""

from __future__ import annotations


def overlong_penalty(length: int, max_response_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of a response of `length` tokens, added to its reward.

    With `L_max = max_response_len` and `L_cache = buffer_len`:

        0                                                if length <= L_max - L_cache
        ((L_max - L_cache) - length) / L_cache * factor  if L_max - L_cache < length <= L_max
        -factor                                          if length > L_max

    so the penalty falls linearly from 0 to `-factor` over the last `L_cache` tokens of the budget; a response cut
    off by the length limit has `length = L_max` and gets `-factor`. `buffer_len = 0` is no buffer: no penalty for
    any length within the budget.
    """
    if length > max_response_len:
        return -factor
    start = max_response_len - buffer_len
    if buffer_len <= 0 or length <= start:
        return 0.0
    return (start - length) / buffer_len * factor
