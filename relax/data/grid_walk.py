"""`data=grid_walk`'s prompts: a 4x4 grid drawn as a 32x32 image (the agent a red cell, the goal a green one, grey
elsewhere) and the question of the first move; the environment that answers each move with the new grid is
`relax.agents.grid_walk`. Rendered with Pillow from the seed (no files).
"""

from __future__ import annotations

import random
from typing import Any

GRID = 4  # cells per side
CELL = 8  # pixels per cell: a 32x32 image, which the tiny processor keeps (4 image tokens)
QUESTION = "what is the move?"
AGENT, GOAL, FLOOR = (220, 40, 40), (40, 180, 60), (128, 128, 128)


def render_grid(agent: int, goal: int) -> Any:
    """The grid as a (GRID*CELL)^2 RGB image: cell `agent` red, cell `goal` green (cells numbered row by row)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (GRID * CELL, GRID * CELL), FLOOR)
    draw = ImageDraw.Draw(image)
    for cell, colour in ((goal, GOAL), (agent, AGENT)):
        x, y = (cell % GRID) * CELL, (cell // GRID) * CELL
        draw.rectangle((x, y, x + CELL - 1, y + CELL - 1), fill=colour)
    return image


def generate_grid_walk(num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`num` records {"prompt": [a user message: the start grid, then QUESTION], "label": "<agent>,<goal>"}."""
    rng = random.Random(f"grid_walk:{seed}:{split}")
    out = []
    for _ in range(num):
        agent, goal = rng.sample(range(GRID * GRID), 2)
        out.append({"prompt": [{"role": "user", "content": [{"type": "image", "image": render_grid(agent, goal)},
                                                            {"type": "text", "text": QUESTION}]}],
                    "label": f"{agent},{goal}"})
    return out
