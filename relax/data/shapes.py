"""`data=shapes`: the built-in image task, rendered on the fly with Pillow from the seed (no files).

Each prompt is one image, a filled circle, square or triangle of one of `COLOURS` at a random place and size on a
grey background, and the question "what colour is the shape?"; the label is the colour's name. The reward
(`relax.rewards.shapes.shapes_reward`) gives partial credit for answering with colour words at all, so a tiny random
model gets a signal from step 0, and full credit only for the right colour, which needs the image: a blind policy
(`blank=True`: every image replaced by the background alone) can earn at most 0.5 + 0.5 / len(COLOURS).
"""

from __future__ import annotations

import random
from typing import Any

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "what colour is the shape?"
BACKGROUND = (128, 128, 128)
SIZE = 32  # pixels per side; the tiny processor keeps 32x32 (4 image tokens)


def render_shape(colour: str, shape: str, box: tuple[int, int, int, int], size: int = SIZE) -> Any:
    """A `size` x `size` RGB image: `shape` filled with `colour` inside `box` (x0, y0, x1, y1) on the background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image


def blank_image(size: int = SIZE) -> Any:
    """The background alone (the blind arm's image)."""
    from PIL import Image

    return Image.new("RGB", (size, size), BACKGROUND)


def generate_shapes(num: int, seed: int, split: str = "train", blank: bool = False) -> list[dict[str, Any]]:
    """`num` records {"prompt": [a user message: the image, then QUESTION], "label": colour}, drawn from (seed,
    split); `blank`: the same records with blank images (labels unchanged)."""
    rng = random.Random(f"shapes:{seed}:{split}")
    names = sorted(COLOURS)
    out = []
    for _ in range(num):
        colour, shape = names[rng.randrange(len(names))], SHAPES[rng.randrange(len(SHAPES))]
        side = rng.randrange(SIZE // 2, SIZE - 2)
        x0, y0 = rng.randrange(0, SIZE - side), rng.randrange(0, SIZE - side)
        image = blank_image() if blank else render_shape(colour, shape, (x0, y0, x0 + side - 1, y0 + side - 1))
        out.append({"prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                            {"type": "text", "text": QUESTION}]}],
                    "label": colour})
    return out
