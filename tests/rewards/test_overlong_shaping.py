"""DAPO's soft overlong punishment (relax.rewards.shaping.overlong_penalty) against eq. 13 of the paper, by hand."""

from __future__ import annotations

import pytest

from relax.rewards import overlong_penalty


# L_max = 8, L_cache = 3, factor = 0.5: no penalty up to 8 - 3 = 5 tokens, then (5 - |y|) / 3 * 0.5
@pytest.mark.parametrize("length,expected", [
    (0, 0.0),
    (4, 0.0),
    (5, 0.0),  # exactly L_max - L_cache: the last unpenalised length
    (6, -1 / 6),  # one token into the buffer: (5 - 6) / 3 * 0.5
    (7, -1 / 3),
    (8, -0.5),  # L_max (a response cut off by the limit): -factor
    (9, -0.5),  # beyond L_max (not produced by a generation that stops at L_max): -factor
])
def test_penalty_at_the_buffer_edges(length, expected):
    assert overlong_penalty(length, 8, 3, 0.5) == pytest.approx(expected, abs=1e-12)


def test_the_penalty_is_linear_in_the_buffer_and_scales_with_the_factor():
    # L_max = 4, L_cache = 3 (the largest buffer validation allows): 1 token free, then -1/3, -2/3, -1 times factor
    assert [overlong_penalty(n, 4, 3, 2.0) for n in range(1, 5)] == pytest.approx([0.0, -2 / 3, -4 / 3, -2.0])


def test_no_buffer_no_penalty_within_the_budget():
    assert [overlong_penalty(n, 4, 0, 1.0) for n in range(5)] == [0.0] * 5
    assert overlong_penalty(5, 4, 0, 1.0) == -1.0
