"""The digits reward: hand-computed cases and the reward of a uniformly random policy."""

from __future__ import annotations

import random

import pytest

from relax.data.tokenizer import build_tiny_tokenizer
from relax.rewards import digits_reward


@pytest.mark.parametrize("response, label, expected", [
    ("7", "7", 1.0),
    ("7777", "7", 1.0),
    (" 7 \n", "7", 1.0),
    ("3", "7", 0.5),  # all digits, wrong digit
    ("7 3", "7", 0.5 * 1 + 0.5 * 1 / 2),
    ("73333", "7", 0.5 * 1 + 0.5 * 1 / 4),  # only the first K=4 units are compared
    ("7 repeat", "7", 0.5 * 1 / 2 + 0.5 * 1 / 2),  # a word is one unit
    ("repeat", "7", 0.0),
    ("+7", "7", 0.5 * 1 / 2 + 0.5 * 1 / 2),
    ("", "7", 0.0),
    ("   ", "7", 0.0),
    ("47", "47", 1.0),  # multi-digit labels are compared position by position
    ("4", "47", 0.5 + 0.5),  # K is capped at the number of units
    ("74", "47", 0.5),
    ("7", "", 0.0),
])
def test_digits_reward_hand_computed(response, label, expected):
    assert digits_reward(response, label) == pytest.approx(expected)


def test_random_policy_earns_partial_reward():
    """Uniform random tokens over the whole tiny vocabulary, at most 8 of them, stopping at eos (as the
    rollout engine samples and decodes): the expected reward must be clearly above 0 so RL has signal from
    step 0. Monte Carlo, fixed seed."""
    tok = build_tiny_tokenizer()
    rng = random.Random(0)
    vocab = len(tok)
    total, n = 0.0, 20000
    for _ in range(n):
        label = str(rng.randrange(10))
        ids = []
        for _ in range(8):
            t = rng.randrange(vocab)
            ids.append(t)
            if t == tok.eos_token_id:
                break
        total += digits_reward(tok.decode(ids, skip_special_tokens=True), label)
    mean = total / n
    assert mean >= 0.1, mean
    assert mean < 0.5  # and far from solved: the task is still something to learn
