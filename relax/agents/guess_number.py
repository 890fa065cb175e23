"""`data=guess_number`: the environment holds a secret digit; each turn the model answers a digit and is told `+`
(the secret is higher), `-` (lower) or, when it is right, the episode ends with a reward that shrinks with the turns
taken. Made for the tiny model and its word-level tokenizer (whose vocabulary has digits and symbols): a one-turn
policy can only guess (expected reward 0.1), so what a multi-turn policy earns beyond that it earns by reading the
feedback.
"""

from __future__ import annotations

import re

from relax.agents.protocol import Step

HIGHER, LOWER = "+", "-"
INVALID = "?"  # a message without a digit
REWARD_DECAY = 0.2  # reward = max(MIN_REWARD, 1 - REWARD_DECAY * (turns - 1)) when the secret is found
MIN_REWARD = 0.2
_DIGIT = re.compile(r"\d")


def found_reward(turns: int) -> float:
    """The reward for finding the secret at turn `turns` (1-based)."""
    return max(MIN_REWARD, 1.0 - REWARD_DECAY * (turns - 1))


class GuessNumber:
    """The environment (`relax.agents.protocol.Environment`): the secret is the item's label; a guess is the first
    digit of the model's message. Deterministic in (item, actions), so episodes resume by replay."""

    def reset(self, item: dict) -> None:
        self.secret = int(item["label"])
        self.turns = 0

    def step(self, action: str) -> Step:
        self.turns += 1
        match = _DIGIT.search(action)
        if match is None:
            return Step(INVALID, 0.0, False)
        guess = int(match.group())
        if guess == self.secret:
            return Step(None, found_reward(self.turns), True)
        return Step(HIGHER if self.secret > guess else LOWER, 0.0, False)
