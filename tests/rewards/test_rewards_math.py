"""Math rewards: boxed extraction, math-verify equivalence, fallbacks, threads."""

from __future__ import annotations

import threading

import pytest

from relax.rewards import arithmetic_reward, extract_boxed, math_reward


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{7}", "7"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{\\sqrt{2}}{\\{3\\}}}", "\\frac{\\sqrt{2}}{\\{3\\}}"),
    ("\\boxed{ 42 }.", "42"),
    ("no box 7", None),
    ("\\boxed{7", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("response, label, expected", [
    ("The answer is \\boxed{7}.", "7", 1.0),
    ("\\boxed{8}", "7", 0.0),
    ("7", "7", 0.0),  # no box: no reward
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{1,200}", "1200", 1.0),
    ("\\boxed{1200.0}", "1200", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("first \\boxed{3} finally \\boxed{4}", "4", 1.0),
    ("\\boxed{x+1}", "1+x", 1.0),
])
def test_math_reward(response, label, expected):
    assert math_reward(response, label) == expected


def test_arithmetic_reward_partial_credit_without_box():
    assert arithmetic_reward("3 + 4 = \\boxed{7}", "7") == 1.0
    assert arithmetic_reward("3 + 4 = \\boxed{8}", "7") == 0.0
    assert arithmetic_reward("3 + 4 = 7", "7") == 0.5
    assert arithmetic_reward("3 + 4 = 8", "7") == 0.0
    assert arithmetic_reward("", "7") == 0.0


def test_math_reward_works_outside_the_main_thread():
    """math-verify's SIGALRM timeouts fail outside the main thread; the reward must still verify there."""
    results = []
    t = threading.Thread(target=lambda: results.append(math_reward("\\boxed{\\frac{2}{4}}", "0.5")))
    t.start()
    t.join()
    assert results == [1.0]
