"""`data=grid_walk`'s environment: a small visual game for vision-language models (image observations). The grid
(`relax.data.grid_walk`: the agent a red cell, the goal a green one); each turn the model answers a move, the first
digit of its message (1 up, 2 down, 3 left, 4 right; anything else stays), and sees the new grid as an image (an image
observation: `relax.agents.protocol`). Reaching the goal ends the episode with a reward that shrinks with the turns
taken. The grid is only in the images: a policy that reads them can walk straight to the goal.
"""

from __future__ import annotations

import re

from relax.agents.protocol import Step
from relax.data.grid_walk import GRID, QUESTION, render_grid

MOVES = {"1": (0, -1), "2": (0, 1), "3": (-1, 0), "4": (1, 0)}  # up, down, left, right: (dx, dy)
REWARD_DECAY = 0.2
_DIGIT = re.compile(r"\d")


class GridWalk:
    """The environment (`relax.agents.protocol.Environment`); deterministic in (item, actions), so episodes resume
    by replay."""

    def reset(self, item: dict) -> None:
        self.agent, self.goal = (int(v) for v in str(item["label"]).split(","))
        self.turns = 0

    def step(self, action: str) -> Step:
        self.turns += 1
        match = _DIGIT.search(action)
        if match is not None and match.group() in MOVES:
            dx, dy = MOVES[match.group()]
            x, y = self.agent % GRID + dx, self.agent // GRID + dy
            if 0 <= x < GRID and 0 <= y < GRID:
                self.agent = y * GRID + x
        if self.agent == self.goal:
            return Step(None, max(REWARD_DECAY, 1.0 - REWARD_DECAY * (self.turns - 1)), True)
        return Step([{"type": "image", "image": render_grid(self.agent, self.goal)},
                     {"type": "text", "text": QUESTION}], 0.0, False)
